"""Llama 4: top-k of the router logits, each expert's sigmoid score multiplied into the token *before* the expert.

``Llama4TextMoe`` computes ``scores = sigmoid(top-k logits)`` ``[T, E]`` (0 off the top k), then
``routed_in = x.repeat(E, 1) * scores.T.reshape(-1, 1)`` ``[E*T, H]`` and calls ``self.experts(routed_in)``,
which runs every expert on all T rows of its block (``[E, T, H] @ gate_up [E, H, 2I]``), and sums the E
blocks with its ``shared_expert``. Because the score scales the expert's input, not its output, an expert's
contribution is not linear in it; moetune keeps that order: ``PrescaledDenseExperts`` hands the engine each
non-zero row with its expert and weight 1 (see there why skipping the zero rows is exact).

``Llama4TextExperts`` has no ``use_experts_implementation`` flags; its layout is fixed by the class:
gate_up ``[E, H, 2I]`` (``x @ W``), gate block then up block, down ``[E, I, H]``, no biases, ``act_fn`` from
``hidden_act``. Its checkpoints store the same fused tensors. The shared expert runs on the model's device;
it is called on the block's input, not on ``routed_in``, so it is not overlapped with the engine.
"""

from moetune.arch.spec import ArchSpec, ExpertsCall, LayoutFlags, Routing, register

LLAMA4 = register(
    ArchSpec(
        name="llama4",
        model_types=("llama4", "llama4_text"),
        routing=Routing.TOPK_SIGMOID_PRESCALED,
        router_attr="router",
        layout=LayoutFlags(is_transposed=True, is_concatenated=True, has_bias=False, has_gate=True),
        call=ExpertsCall.PRESCALED_DENSE,
    )
)
