"""Multi-process runs shared by ``tests/integration/test_dist_*.py`` and ``tests/slow/test_dist_*.py``.

Each check starts ``torchrun --nproc-per-node 2`` (gloo on the CPU) as a child process running this file's
``__main__`` (or ``moetune train``), and the single-process reference as a plain child process, so the tests'
own process never joins a process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from moetune.testing.child import child_env
from tests.integration import test_train

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = [sys.executable, "-m", "torch.distributed.run"]


def env(gpus: bool = False) -> dict[str, str]:
    """The ranks' environment: one intra-op thread; no CUDA device visible unless ``gpus`` (the CPU runs these
    tests stand for; on a machine with one GPU, two ranks would otherwise each be given a device, rank 1 one that
    does not exist)."""
    return child_env(OMP_NUM_THREADS="1", **({} if gpus else {"CUDA_VISIBLE_DEVICES": ""}))


def _run(cmd: list[str], timeout: float, gpus: bool = False) -> subprocess.CompletedProcess:
    """``cmd`` in its own session (``env(gpus)``); on timeout the whole session (launcher and ranks) is killed."""
    with subprocess.Popen(
        cmd,
        env=env(gpus),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"{cmd} did not end within {timeout} s:\n{out[-3000:]}\n{err[-6000:]}"
            ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(
    *args: str, timeout: float = 240, nproc: int = 2, gpus: bool = False
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC ARGS`` (``-m moetune.cli.main train CFG`` or this module's
    checks); --standalone: a rendezvous on a free local port, so tests running side by side do not collide."""
    return _run([*LAUNCHER, "--standalone", "--nproc-per-node", str(nproc), *args], timeout, gpus)


def nodes(
    *args: str,
    nnodes: int = 2,
    nproc: int = 1,
    timeout: float = 240,
    node_args: list[tuple[str, ...]] | None = None,
) -> list[subprocess.CompletedProcess]:
    """``nnodes`` torchrun invocations on this machine acting as nodes (``--nnodes N --node-rank i``, the static
    rendezvous of node 0 at 127.0.0.1 on a free port), ``nproc`` processes each, run side by side; their results
    in node order. Each node's processes see LOCAL_RANK 0 .. nproc-1 and RANK i * nproc + LOCAL_RANK.
    ``node_args``: node i runs ``node_args[i]`` instead of ``args``."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as sock:  # a free port for node 0's store (released just before torchrun binds it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    common = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1"]
    common += ["--master-port", str(port)]
    with ThreadPoolExecutor(nnodes) as pool:
        runs = [
            pool.submit(
                _run,
                [*LAUNCHER, *common, "--node-rank", str(i), *(node_args[i] if node_args else args)],
                timeout,
            )
            for i in range(nnodes)
        ]
        return [r.result() for r in runs]


def single(*args: str, timeout: float = 240, gpus: bool = False) -> subprocess.CompletedProcess:
    """One process: ``python ARGS``."""
    return _run([sys.executable, *args], timeout, gpus)


def config(tmp: Path, model: Path, name: str, **over: Any) -> Path:
    """``test_train``'s LoRA sft config on the demo data (every target, experts included) in ``tmp/name``,
    writing to ``tmp/name/out``; collectives time out after 120 s (above the tests' 90 s limit on a hang)."""
    folder = tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    return test_train._config(folder, model, **{"max_steps": 3, "ddp_timeout": 120, **over})


def losses(out: Path) -> list[tuple[int, float]]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


def check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def adapter(folder: Path) -> dict[str, Any]:
    """The tensors of ``folder/adapter_model.safetensors``."""
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def assert_same_run(got: Path, want: Path) -> None:
    """Every step's loss of two runs' output folders (a resumed run's log history starts with its checkpoint's;
    steps 1-4, rel 1e-5) and every final adapter tensor (rtol 1e-4, atol 1e-6)."""
    import pytest
    import torch

    got_losses, want_losses = dict(losses(got)), dict(losses(want))
    assert sorted(got_losses) == [1, 2, 3, 4]
    for step in got_losses:
        assert got_losses[step] == pytest.approx(want_losses[step], rel=1e-5, abs=1e-6), (got, step)
    a, b = adapter(got), adapter(want)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=f"{got}: {key}")


def _fail_on_rank(config_path: str, failing: str, where: str = "model") -> None:
    """``moetune train``'s recipe with a forward hook that raises on rank ``failing`` at its third forward
    (mid-training, while the other rank waits in DDP's all-reduce); ``where="experts"``: the hook is on the first
    routed-experts module instead, so with sharded experts the other rank waits inside that layer's exchange."""
    from moetune.config import load_config
    from moetune.dist import failures_end_every_rank
    from moetune.train import recipe

    cfg = load_config(config_path)
    ranks = recipe._start_ranks(cfg)
    calls = []

    def hook(module: Any, args: Any, output: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(f"injected failure on rank {failing}")

    with failures_end_every_rank(ranks):
        model, tokenizer, data = recipe.setup(cfg, progress=False)
        if ranks.rank == int(failing):
            from moetune.layer import CpuExperts

            experts = [m for m in model.modules() if isinstance(m, CpuExperts)]
            (model if where == "model" else experts[0]).register_forward_hook(hook)
        recipe.train(cfg, model, tokenizer, data)


def _train_folded(config_path: str, experts: str) -> None:
    """``moetune train``'s recipe (setup, train, save) with the first MoE block's router folded to experts
    ``[0, experts)`` (``_fold``): with sharded experts every slot of that layer goes to the first ranks, and the
    others' experts receive no token there. The same on one process (the reference) as on several."""
    import time

    from moetune.config import load_config
    from moetune.dist import failures_end_every_rank
    from moetune.layer import CpuExperts
    from moetune.train import recipe

    cfg = load_config(config_path)
    ranks = recipe._start_ranks(cfg)
    start = time.perf_counter()
    with failures_end_every_rank(ranks):
        model, tokenizer, data = recipe.setup(cfg, progress=False)
        sites = sorted(n for n, m in model.named_modules() if isinstance(m, CpuExperts))
        block = sites[0].split(".experts")[0]
        model.get_submodule(block + ".gate").register_forward_hook(
            lambda module, args, out: (*out[:2], _fold(out[2], int(experts)))
        )
        trainer = recipe.train(cfg, model, tokenizer, data)
        recipe.save(cfg, trainer, tokenizer, time.perf_counter() - start)
    # one write per line (print under python -u writes the newline apart: the ranks' lines interleaved)
    sys.stdout.write(f"rank {ranks.rank} of {ranks.world} (local {ranks.local_rank}): trained\n")
    sys.stdout.flush()


def _adapter_saves_on_every_rank(folder: str) -> None:
    """Both ranks save an adapter pair into ``folder`` 20 times (the main process alone writes; the other logs
    and returns), then rank 1 meets an interrupted save and must refuse to recover it itself."""
    from pathlib import Path

    import torch.distributed as dist

    from moetune.adapters.swap import PARTIAL, recover_adapter, save_pair
    from moetune.dist import barrier, failures_end_every_rank, start
    from moetune.errors import AdapterError

    ranks = start(cpu=True, timeout_s=60)
    out = Path(folder)
    with failures_end_every_rank(ranks):
        for i in range(20):
            save_pair(
                out, f'{{"i": {i}}}', lambda path, i=i: path.write_text(f"weights {i} of rank {ranks.rank}")
            )
        barrier(ranks)
        assert (out / "adapter_model.safetensors").read_text() == "weights 19 of rank 0"
        if ranks.is_main:
            (out / PARTIAL).mkdir()
        barrier(ranks)
        if ranks.rank == 1:
            try:
                recover_adapter(out)
            except AdapterError as err:
                print(f"rank 1 refused: {err}", flush=True)
        barrier(ranks)
        assert (out / PARTIAL).is_dir()  # nobody touched it
    dist.destroy_process_group()


def _ffn(x: Any, w1: Any, w2: Any) -> Any:
    """One expert, SwiGLU: ``x [M, H]``, ``w1 [2I, H]`` (gate rows then up rows), ``w2 [H, I]``."""
    import torch

    gate, up = (x @ w1.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.T


def _sharded_exchange() -> None:
    """Each rank computes a tiny MoE layer (E=8 experts, k=2, float64) with its 4 experts only, tokens exchanged
    with ``moetune.dist.exchange``; compared with every expert computed in this process from the same weights:
    the output, the gradients of the input and of the routing weights, and of this rank's expert weights (the
    reference's summed over both ranks' tokens). Routing is uneven: rank 0 sends most slots to rank 1's experts,
    rank 1 keeps most of its own, and some tokens of rank 1 go nowhere but rank 1."""
    import torch
    import torch.distributed as dist

    from moetune.dist import failures_end_every_rank, start
    from moetune.dist.exchange import ExpertOwners, sharded_experts

    ranks = start(cpu=True, timeout_s=60)
    num_experts, hidden, inter, k = 8, 6, 5, 2
    owners = ExpertOwners(num_experts, ranks.world)
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, dtype=torch.float64)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, dtype=torch.float64)
    gen.manual_seed(1 + ranks.rank)
    tokens = 7 if ranks.rank == 0 else 12  # different token counts per rank
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    mine = ranks.rank * owners.per_rank
    bias = torch.zeros(num_experts, dtype=torch.float64)
    bias[4:] += 3.0  # both ranks prefer experts 4-7 (rank 1's)
    logits = torch.randn(tokens, num_experts, generator=gen, dtype=torch.float64) + bias
    ids = torch.topk(logits, k).indices  # [T, k]
    weights = torch.softmax(torch.randn(tokens, k, generator=gen, dtype=torch.float64), -1).requires_grad_()
    cotangent = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)

    local1 = w1[mine : mine + owners.per_rank].clone().requires_grad_()
    local2 = w2[mine : mine + owners.per_rank].clone().requires_grad_()

    def local(rows: Any, local_ids: Any) -> Any:
        out = rows.new_zeros(rows.shape)
        for e in range(owners.per_rank):
            sel = local_ids == e
            out = out.index_put((sel.nonzero().squeeze(1),), _ffn(rows[sel], local1[e], local2[e]))
        return out

    with failures_end_every_rank(ranks):  # and the watchdog is stopped before the process group goes
        y = sharded_experts(x, ids, weights, owners, local)
        (y * cotangent).sum().backward()

    ref_x = x.detach().clone().requires_grad_()
    ref_w = weights.detach().clone().requires_grad_()
    full1, full2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ref = torch.zeros_like(ref_x)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            ref = ref.index_add(
                0, torch.tensor([t]), ref_w[t, j] * _ffn(ref_x[t : t + 1], full1[e], full2[e])
            )
    (ref * cotangent).sum().backward()
    for grad in (full1.grad, full2.grad):  # the expert weights see every rank's tokens
        dist.all_reduce(grad)
    assert full1.grad is not None and full2.grad is not None and x.grad is not None
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights.grad, ref_w.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local1.grad, full1.grad[mine : mine + owners.per_rank], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local2.grad, full2.grad[mine : mine + owners.per_rank], rtol=1e-12, atol=1e-12)
    sent = torch.bincount(torch.div(ids.reshape(-1), owners.per_rank, rounding_mode="floor"), minlength=2)
    print(
        f"rank {ranks.rank}: sharded experts equal the reference; slots sent per owner {sent.tolist()}",
        flush=True,
    )
    dist.destroy_process_group()


def _fold(ids: Any, half: int, experts: int | None = None) -> Any:
    """Top-k expert ids ``[T, k]`` moved into ``[0, half)`` (``id % half``, a repeat within a token moved on to
    the next free id): uneven routing on purpose. ``experts``: E, where ids ``>= E`` name zero-computation
    experts (LongCat-Flash), which stay as they are."""
    real = ids >= 0 if experts is None else ids < experts
    out = ids.where(~real, ids % half)
    for t in range(out.shape[0]):
        for j in range(1, out.shape[1]):
            while bool(real[t, j]) and bool((out[t, :j] == out[t, j]).any()):
                out[t, j] = (out[t, j] + 1) % half
    return out


def _fold_call(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook of an experts module (any call form) sending every routed slot of its layer to experts
    ``[0, E / 2)``, rank 0's of two: Llama 4's ``routed_in [E*T, H]`` has expert e's block of rows added onto
    expert ``e % (E / 2)``'s (still each token scaled by a sum of its scores), the other calls have their
    routed ids folded (``_fold``; zero-computation ids kept)."""
    import torch

    experts = module.num_experts
    half = experts // 2
    if len(args) == 1:
        routed = args[0]
        blocks = routed.view(2, half, -1, routed.shape[-1]).sum(0)  # [E/2, T, H]
        return (torch.cat([blocks, torch.zeros_like(blocks)]).view(routed.shape),)
    x, ids, weights = args
    return (x, _fold(ids, half, experts), weights)


def _same_adapter(ref: Any, mine: Any, folder: Path, ranks: Any) -> None:
    """The adapter the sharded model writes (its held expert LoRA gathered to the main process weight by weight,
    ``GatheredAdapter``) equals the one-process model's file: every key, shape and value, with the expert LoRA's
    whole shapes (the zero-computation experts' rows included)."""
    import torch
    from safetensors.torch import load_file

    from moetune.adapters.save import adapter_state, write_adapter_weights
    from moetune.dist import barrier
    from moetune.train.sharded_lora import ShardedLora

    lora = ShardedLora.of(mine)
    if lora is None:  # no expert LoRA: nothing is gathered
        return
    gathered = lora.gathered_adapter(mine)
    if gathered.state_dict is None:
        gathered.send()
        barrier(ranks)
        return
    folder.mkdir(exist_ok=True)
    write_adapter_weights(ref, folder / "ref.safetensors")
    write_adapter_weights(mine, folder / "sharded.safetensors", gathered.state_dict, gathered.fetch)
    gathered.check_written()
    want, got = load_file(folder / "ref.safetensors"), load_file(folder / "sharded.safetensors")
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        assert got[key].shape == value.shape and torch.equal(got[key], value), key
    whole = {k: v for k, v in adapter_state(mine, gathered.state_dict).items() if v.is_meta}
    assert len(whole) == len(lora.tensors)  # each held weight is in the file whole: E (+ Z) experts' rows
    for key, placeholder in whole.items():
        assert got[key].shape == placeholder.shape, key
    barrier(ranks)


def _sharded_model(model_dir: str, targets: str = "") -> None:
    """A tiny MoE model loaded twice on each rank, with every expert (the reference) and with
    ``expert_parallel: sharded`` (this rank's experts only, tokens exchanged), LoRA on ``targets`` (comma-
    separated; default every target) with the same random values on both (B too, so every LoRA gradient is
    non-zero), gradient checkpointing on the sharded one (its recompute repeats the exchange), different token
    counts per rank, and the first MoE layer routing every slot to rank 0's experts (``_fold_call``: rank 1's
    engine receives no row there): the logits, the loss and the gradients of the input embeddings and of every
    non-expert LoRA tensor equal the reference's on each rank; each rank holds only its experts' LoRA rows
    (loaded from the whole values), whose gradient equals those rows of the reference's gradient summed over
    the ranks (every rank's tokens reach the owner). The sharded modules are those of the family's call form."""
    import torch
    import torch.distributed as dist

    from moetune.adapters.apply import attach_lora
    from moetune.adapters.expert_rows import held_part
    from moetune.dist import failures_end_every_rank, start
    from moetune.layer import EXPERTS_MODULES, CpuExperts
    from moetune.layer.sharded import SHARDED_MODULES, ShardedExperts
    from moetune.loading import load_model
    from moetune.train.sharded_lora import expert_lora_tensors

    ranks = start(cpu=True, timeout_s=60)
    kwargs: dict[str, Any] = dict(device="cpu", dtype="float32", num_threads=1, progress=False)
    with failures_end_every_rank(ranks):
        ref = load_model(model_dir, **kwargs)
        mine = load_model(model_dir, **kwargs, expert_parallel="sharded")
        sites = {n: m for n, m in mine.named_modules() if isinstance(m, CpuExperts)}
        assert sites and all(isinstance(m, ShardedExperts) for m in sites.values())
        calls = {c for c, cls in SHARDED_MODULES.items() if all(type(m) is cls for m in sites.values())}
        assert len(calls) == 1 and isinstance(next(iter(sites.values())), EXPERTS_MODULES[calls.pop()])
        for name, module in sites.items():
            whole = ref.get_submodule(name).engine.weights
            e = module.owners.per_rank
            assert module.engine.num_experts == e == whole.gate_up.shape[0] // ranks.world
            held = slice(ranks.rank * e, (ranks.rank + 1) * e)
            assert torch.equal(module.engine.weights.gate_up, whole.gate_up[held])
            assert torch.equal(module.engine.weights.down, whole.down[held])
        first = sorted(sites)[0]  # its block routes every slot to rank 0's experts: rank 1 receives none
        half = sites[first].owners.per_rank
        models = []
        chosen = {"targets": tuple(targets.split(","))} if targets else {}
        for model in (ref, mine):
            model.get_submodule(first).register_forward_pre_hook(_fold_call)
            models.append(attach_lora(model, rank=4, alpha=8, **chosen).train())
        gen = torch.Generator().manual_seed(7)
        values = {}
        with torch.no_grad():
            for name, p in sorted(models[0].named_parameters()):
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
                    values[name] = p.detach().clone()
        # the whole values into the sharded model: its expert LoRA layers keep their experts' rows (load pre-hook)
        loaded = models[1].load_state_dict(values, strict=False)
        assert not loaded.unexpected_keys, loaded.unexpected_keys
        held = {t.name: t.rows for t in expert_lora_tensors(models[1], sharded_only=True)}
        last = (
            ranks.rank == ranks.world - 1
        )  # also holds the zero-computation experts' rows (LongCat-Flash's gate_up)
        assert (bool(held) or not ("experts" in targets or not targets)) and all(
            rows.first == ranks.rank * half and rows.count == half + last * (rows.total - ranks.world * half)
            for rows in held.values()
        )
        for name, rows in held.items():
            assert torch.equal(models[1].get_parameter(name), held_part(values[name], rows)), name
        models[1].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        runs: list[
            tuple[str, int]
        ] = []  # engine forwards of the sharded model (layer, rows): the recompute's
        # are reused (layer.memo)
        for name, module in sites.items():
            engine_forward = module.engine.forward
            module.engine.forward = lambda x, *a, f=engine_forward, n=name, **k: (
                runs.append((n, x.shape[0])) or f(x, *a, **k)
            )
        gen = torch.Generator().manual_seed(100 + ranks.rank)
        batch, seq = (2, 9) if ranks.rank == 0 else (3, 5)  # different token counts per rank
        vocab = ref.get_input_embeddings().num_embeddings
        ids = torch.randint(4, vocab, (batch, seq), generator=gen)
        outs, losses, grads = [], [], []
        for peft_model in models:
            embeds = peft_model.get_input_embeddings()(ids).detach().requires_grad_()
            out = peft_model(inputs_embeds=embeds, labels=ids)
            out.loss.backward()
            outs.append(out.logits.detach())
            losses.append(out.loss.detach())
            grads.append(
                {
                    "inputs_embeds": embeds.grad,
                    **{n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad},
                }
            )
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
        # once per layer, though checkpointing ran each layer twice
        assert sorted(n for n, _ in runs) == sorted(sites), runs
        received = dict(runs)
        assert (received[first] == 0) == (ranks.rank == 1), received  # the folded layer: rank 1 got no row
        assert sum(received.values()) > 0, received  # rank 1 too, in another layer
        assert grads[0].keys() == grads[1].keys()
        experts = [n for n in grads[0] if ".experts." in n]
        assert len(experts) < len(grads[0]) and sorted(experts) == sorted(held)
        for name in grads[0]:
            want, got = grads[0][name], grads[1][name]
            assert (want is None) == (got is None), name
            if want is None:  # a target the text never reaches (Muse Spark's vision tower), in both models
                continue
            if name in held:  # the owner's rows hold every rank's tokens' gradient: the reference's summed
                dist.all_reduce(want)
                want = held_part(want, held[name])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)
        _same_adapter(models[0], models[1], Path(model_dir).parent / "adapters", ranks)
        print(
            f"rank {ranks.rank}: the sharded model equals the reference ({len(grads[0])} gradients)",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    checks = {
        "fail_on_rank": _fail_on_rank,
        "adapter_saves_on_every_rank": _adapter_saves_on_every_rank,
        "sharded_exchange": _sharded_exchange,
        "sharded_model": _sharded_model,
        "train_folded": _train_folded,
    }
    checks[sys.argv[1]](*sys.argv[2:])
