"""DBRX: softmax router, top-k, weights renormalised by their p-norm; experts kept as flat matrices.

``DbrxFFN`` calls ``self.experts(x [B, S, H], top_k_index [B*S, k], top_k_weights [B*S, k])`` after its
``router`` and gets ``[B, S, H]`` back (``ExpertsCall.TOPK_BATCHED``: moetune's ``BatchedExperts`` flattens the
tokens for the engine and restores the shape). ``DbrxExperts`` keeps the weights in its ``mlp``
(``DbrxExpertGLU``) as three ``[E*I, H]`` parameters, expert e's rows ``e*I .. (e+1)*I``: ``w1`` the gate and ``v1``
the up projection (``[out, in]``), ``w2`` the down projection transposed (the module computes ``h @ w2_e``);
checkpoints store the same three tensors. The loader reads each expert's block into the engine's layout
(gate rows then up rows, down ``[H, I]``); ``mlp.activation_fn`` (``ffn_act_fn``, SiLU by default) is the gate's.
"""

from moetune.arch.spec import ArchSpec, ExpertsCall, FlatTensors, Routing, register

DBRX = register(
    ArchSpec(
        name="dbrx",
        model_types=("dbrx",),
        routing=Routing.SOFTMAX_TOPK,
        router_attr="router",
        call=ExpertsCall.TOPK_BATCHED,
        flat=FlatTensors(
            gate="mlp.w1",
            up="mlp.v1",
            down="mlp.w2",
            activation="mlp.activation_fn",
            num_experts="num_experts",
        ),
    )
)
