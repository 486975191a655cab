"""Every way a family's block calls its experts (``ExpertsCall``) has a sharded module: the one-process module
of that call form over ``ShardedExperts`` (``moetune.layer.sharded.SHARDED_MODULES``), so no family is refused
with ``expert_parallel: sharded`` for its call form. The numerics over two processes:
``tests/integration/test_dist_exchange.py``."""

from __future__ import annotations

import pytest
import torch

from moetune.arch.spec import ExpertsCall
from moetune.dist.exchange import ExpertOwners
from moetune.engine import DenseExperts, ExpertEngine
from moetune.layer import EXPERTS_MODULES, CpuExperts
from moetune.layer.sharded import SHARDED_MODULES, ShardedExperts


@pytest.mark.parametrize("call", list(ExpertsCall))
def test_every_call_form_has_its_sharded_module(call) -> None:
    cls = SHARDED_MODULES[call]
    assert issubclass(cls, EXPERTS_MODULES[call]) and issubclass(cls, ShardedExperts)
    # the call form's arithmetic first, then the exchange, then the engine (its super().forward chain)
    mro, form = cls.__mro__, EXPERTS_MODULES[call]
    assert mro.index(ShardedExperts) < mro.index(CpuExperts)
    assert form is CpuExperts or mro.index(form) < mro.index(ShardedExperts)
    gen = torch.Generator().manual_seed(0)
    engine = ExpertEngine(DenseExperts(torch.randn(4, 6, 5, generator=gen), torch.randn(4, 5, 3, generator=gen)))
    module = cls(engine, None, owners=ExpertOwners(8, 2), rank=1, group=None)
    assert module.num_experts == 8 and module.first == 4  # the layer's E, over every rank
    assert "experts 4-7 of 8 (rank 1)" in repr(module)

