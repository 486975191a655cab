"""MoE families transformers ships that the engine cannot run, each with the reason ``find_experts`` gives.

Detection alone would only say "no routed-experts module" for these (their experts are not transformers v5
experts modules, or not ones the engine can stand in for); naming the reason tells a user what is missing.
Families refused by detection itself, with its own reason, are not listed.
"""

from moetune.arch.spec import ArchSpec, Routing, register

_REASONS = {
    "doge": (
        "Doge's routed experts are single neurons retrieved by product keys (rows of the down_embed/up_embed "
        "embeddings, mixed inside DogeCDMoE), not expert MLPs the engine could run"
    ),
    "jetmoe": (
        "JetMoE routes inside one module (JetMoeMoE, and JetMoeMoA for its attention experts) through parallel "
        "expert linears called with per-expert token counts, with no experts module of the v5 call "
        "experts(hidden, top_k_index, top_k_weights) to stand in for"
    ),
    "nemo_speechlm": (
        "Nemotron-3.5-Transcribe is a speech-to-text model (audio tower, then a NemotronH language model saved "
        "under llm.): transformers has no causal-LM or image-text-to-text class for it, and moetune does not load "
        "its language model apart from the checkpoint it shares with the audio tower"
    ),
    "diffusion_gemma": (
        "DiffusionGemma ties the experts of its encoder to those of its decoder (one checkpoint tensor feeds two "
        "experts modules), which moetune does not share between engines, and trains with a block-diffusion "
        "objective rather than next-token labels"
    ),
}

for _model_type, _reason in _REASONS.items():
    register(
        ArchSpec(
            name=f"unsupported_{_model_type}",
            model_types=(_model_type,),
            routing=Routing.MODEL_DEFINED,
            router_attr=None,
            unsupported=_reason,
        )
    )
