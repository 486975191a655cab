"""LongCat-Flash: softmax router over E routed and Z zero-computation experts, correction bias, scaled.

``LongcatFlashMoE`` calls ``self.experts(x, topk_indices, topk_weights)`` after its ``router``; ids ``>= E``
(``n_routed_experts``) pick zero-computation experts, which return the token: ``y = sum_j w_j * FFN_j(x)``
with ``FFN_j(x) = x`` for those. ``LongcatFlashExperts`` has no ``use_experts_implementation`` flags (its layout
is gate_up ``[E + Z, 2I, H]``, gate block first, down ``[E, H, I]``, no biases; the Z extra gate_up rows are
never used) and keeps Z in ``zero_expert_num``. moetune's ``IdentityExperts`` computes the identity share on
the device and the E routed experts in the engine; checkpoint tensors of the unused rows are not read. With
``expert_parallel: sharded`` the identity share stays on the token's rank and only routed slots are exchanged.
"""

from moetune.arch.spec import ArchSpec, ExpertsCall, LayoutFlags, Routing, register

LONGCAT_FLASH = register(
    ArchSpec(
        name="longcat_flash",
        model_types=("longcat_flash",),
        routing=Routing.MODEL_DEFINED,
        router_attr="router",
        layout=LayoutFlags(is_transposed=False, is_concatenated=True, has_bias=False, has_gate=True),
        call=ExpertsCall.TOPK_WITH_IDENTITY,
        identity_attr="zero_expert_num",
    )
)
