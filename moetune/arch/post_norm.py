"""Muse Spark: each expert's output normalised before its routing weight applies (``post_expert_norm``).

``MuseSparkMoE`` projects the token down (``pre_expert_proj``, ``pre_expert_norm``) and calls
``self.experts(x, topk_indices, topk_weights)`` after its ``gate`` router; ``MuseSparkExperts`` (transformers'
``has_post_expert_norm=True``) computes ``y = sum_j w_j * norm(FFN_j(x))``, ``norm`` its ``post_expert_norm``
module (an RMS norm with a learned scale ``1 + weight``). The norm sits inside the weighted sum, so it cannot run
after the engine's combine; moetune's ``PostNormExperts`` asks the engine for the unweighted output of every
(token, slot) row and applies the module's own norm and the weights on the device, where autograd gives the
norm's weight and the routing weights their exact gradients. The norm stays a torch module of the model
(``kept_modules``), loaded from the checkpoint like any other non-expert tensor.
"""

from moetune.arch.spec import ArchSpec, ExpertsCall, Routing, register

MUSE_SPARK = register(
    ArchSpec(
        name="muse_spark",
        model_types=("muse_spark", "muse_spark_text"),
        routing=Routing.MODEL_DEFINED,  # sigmoid scores + correction bias, group-limited (MuseSparkTopkRouter)
        router_attr="gate",
        call=ExpertsCall.TOPK_POST_NORM,
        kept_modules=("post_expert_norm",),
    )
)
