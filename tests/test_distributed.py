"""Global negatives across processes: two gloo processes on CPU give the loss and gradients of
one process on the concatenated batch."""

import importlib
import os
import random
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastcl import checkpoint, distributed, objectives, training
from fastcl.encoders import MLPHead, SentenceEncoder, dropout_rate, load_backbone
from test_evaluate import make_tiny_model, random_sentence

WORLD, N, D = 2, 8, 16  # processes, global batch, width
METHODS = ["simcse", "simcse-sup", "focal", "dclr", "escl"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, *args):
    port = free_port()
    mp.spawn(fn, args=(port, *args), nprocs=WORLD, join=True)


def join(rank, port):
    torch.set_num_threads(1)
    distributed.join_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)


def objective(method):
    gen = torch.Generator().manual_seed(5)
    return {"simcse": objectives.Objective("simcse"),
            "simcse-sup": objectives.Objective("simcse-sup", hard_negative_weight=0.7),
            "focal": objectives.Objective("focal", m=0.4),
            "dclr": objectives.Objective("dclr", phi=0.4, noise_ratio=1.5, noise_steps=2, generator=gen),
            "escl": objectives.Objective("escl", rd_weight=0.5)}[method]


def global_inputs():
    """The views of the concatenated batch, made as linear maps of fixed inputs by a shared
    weight (so a parameter gradient can be compared too), and complementary embeddings."""
    g = torch.Generator().manual_seed(0)
    x = {k: torch.randn(N, 12, generator=g) for k in ("anchors", "positives", "negatives", "sensitive")}
    x["positives"] = x["anchors"] + 0.5 * x["positives"]
    weight = torch.randn(12, D, generator=g)
    comp = torch.randn(N, 6, generator=g)
    return x, weight, comp


def views_of(method, x, weight, comp, rows):
    names = {"simcse-sup": ("anchors", "positives", "negatives"),
             "escl": ("anchors", "positives", "sensitive")}.get(method, ("anchors", "positives"))
    views = {k: x[k][rows] @ weight for k in names}
    if method == "dclr":
        views["complementary"] = (comp[rows], comp[rows])
    return views


def single_process(method):
    x, weight, comp = global_inputs()
    weight.requires_grad_(True)
    views = views_of(method, x, weight, comp, slice(None))
    for v in views.values():
        if torch.is_tensor(v):
            v.retain_grad()
    loss = objectives.objective_loss(objective(method), views)
    loss.backward()
    grads = {k: v.grad for k, v in views.items() if torch.is_tensor(v)}
    return loss.detach(), grads, weight.grad


def _functional_worker(rank, port, out):
    join(rank, port)
    results = {}
    for method in METHODS:
        x, weight, comp = global_inputs()
        weight.requires_grad_(True)
        rows = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
        views = views_of(method, x, weight, comp, rows)
        leaves = {k: v.detach().requires_grad_(True) for k, v in views.items() if torch.is_tensor(v)}
        local = dict(views, **leaves)
        obj = objective(method)
        loss = objectives.objective_loss(obj, *distributed.global_views(obj, local))
        loss.backward()
        # the parameter: back-propagate the leaves' gradients, then average over processes
        torch.autograd.backward([views[k] for k in leaves], [leaves[k].grad for k in leaves])
        distributed.average_gradients([weight])
        results[method] = {"loss": distributed.mean(float(loss)),
                           "grads": {k: v.grad for k, v in leaves.items()}, "weight": weight.grad}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_global_loss_and_gradients_equal_one_process(tmp_path):
    spawn(_functional_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for method in METHODS:
        loss, grads, weight_grad = single_process(method)
        for rank, res in enumerate(ranks):
            got = res[method]
            assert got["loss"] == pytest.approx(float(loss), rel=1e-6, abs=1e-6), method
            rows = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
            assert got["grads"].keys() == {k for k in grads if k != "complementary"}
            for k, g in got["grads"].items():
                # the gather's backward sums the contributions of all WORLD processes; the
                # gradient average over processes then divides by WORLD
                torch.testing.assert_close(g, WORLD * grads[k][rows], atol=1e-6, rtol=1e-5,
                                           msg=f"{method} {k} rank {rank}")
            torch.testing.assert_close(got["weight"], weight_grad, atol=1e-6, rtol=1e-5, msg=method)


# ---------------------------------------------------------------------------------------
# One training step of a tiny encoder

@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    make_tiny_model(root / "bert")
    return root / "bert"


def step_inputs(method):
    rng = random.Random(3)
    if method == "simcse-sup":
        return [tuple(random_sentence(rng) for _ in range(3)) for _ in range(N)]
    return [random_sentence(rng) for _ in range(N)]


def one_step(model, method, batch, mini_batch_size, distributed_step):
    torch.manual_seed(0)
    backbone, tokenizer = load_backbone(model)
    encoder = SentenceEncoder(backbone, "cls", MLPHead(32)).train()
    obj = objective(method)
    obj.sensitive_dropout = 0.0  # escl's third view too
    opt = torch.optim.SGD(encoder.parameters(), lr=1.0)
    sched = training.linear_schedule(opt, 10)
    # Without dropout the forwards of one process and of two agree (dropout masks are per
    # process by design), so the step must give the parameters of one process.
    with dropout_rate(encoder, 0.0):
        out = training.train_step(obj, encoder, tokenizer, batch, opt, sched, max_length=16,
                                  max_grad_norm=1e9, mini_batch_size=mini_batch_size,
                                  distributed=distributed_step)
    return out["loss"], {k: v.detach() for k, v in encoder.state_dict().items()}


def _step_worker(rank, port, out, model):
    join(rank, port)
    results = {}
    for method in METHODS:
        batch = step_inputs(method)
        share = batch[rank * N // WORLD:(rank + 1) * N // WORLD]
        results[method] = one_step(model, method, share, 3, True)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_chunked_train_step_on_two_processes_equals_one_process(tmp_path, tiny_bert):
    spawn(_step_worker, str(tmp_path), str(tiny_bert))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    torch.set_num_threads(1)
    for method in METHODS:
        loss, params = one_step(tiny_bert, method, step_inputs(method), None, False)
        for res in ranks:
            got_loss, got = res[method]
            assert got_loss == pytest.approx(loss, rel=1e-5), method
            for k in params:
                torch.testing.assert_close(got[k], params[k], atol=1e-5, rtol=1e-5, msg=f"{method} {k}")


def _gloo_threads() -> list[str]:
    return [name for name in (open(f"/proc/self/task/{t}/comm").read().strip()
                              for t in os.listdir("/proc/self/task")) if "gloo" in name]


def _leave_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    distributed.init_from_environment("cpu")
    # torch's sharded-tensor code imports this module lazily, after the group exists
    importlib.import_module("torch.distributed.nn.functional")
    distributed.gather_objects(rank)
    running = _gloo_threads()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{len(running)} {len(_gloo_threads())}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through /proc (Linux)")
def test_leaving_the_group_stops_its_threads(tmp_path):
    # A group that outlives destroy_process_group keeps gloo's workers running into
    # interpreter shutdown, where one that frees its last collective's tensors (it needs the
    # GIL) aborts the process: torchrun then reports a finished run as failed.
    spawn(_leave_worker, str(tmp_path))
    for r in range(WORLD):
        before, after = map(int, (tmp_path / f"rank{r}.txt").read_text().split())
        assert before > 0, "no gloo thread seen while the group was up: the check sees nothing"
        assert after == 0, f"rank {r}: {after} gloo thread(s) still run after destroy_process_group"


# ---------------------------------------------------------------------------------------
# torchrun train.py

def test_torchrun_trains_checkpoints_and_resumes(tmp_path, tiny_bert):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rng = random.Random(1)
    data = tmp_path / "train.txt"
    data.write_text("".join(random_sentence(rng) + "\n" for _ in range(32)))
    out = tmp_path / "out"

    def run(steps, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(root / "train.py"), "--method", "dclr", "--model", str(tiny_bert), "--data", str(data),
               "--output-dir", str(out), "--batch-size", "8", "--max-steps", str(steps),
               "--max-seq-len", "16", "--device", "cpu", "--mini-batch-size", "5", *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    done = run(2, "--keep-checkpoint")  # read below, and resumed
    assert done.returncode == 0, done.stderr[-3000:]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["processes"] == WORLD
    assert [r["step"] for r in log if r["type"] == "step"] == [1, 2]  # rank 0 alone writes
    ckpt = checkpoint.read_checkpoint(out / "checkpoint.pt")
    assert ckpt["world_size"] == WORLD and len(ckpt["rng_ranks"]) == WORLD
    assert not torch.equal(ckpt["rng_ranks"][0]["torch"], ckpt["rng_ranks"][1]["torch"])
    assert (out / "model.safetensors").is_file()
    done = run(2, "--resume", "--keep-checkpoint")  # every process reads its own random state back
    assert done.returncode == 0, done.stderr[-3000:]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["type"] == "step"] == [1, 2]
    script = done.args.index(str(root / "train.py"))
    one = subprocess.run([sys.executable, *done.args[script:]], env=dict(os.environ, HF_HUB_OFFLINE="1"),
                         capture_output=True, text=True, timeout=300)  # one process, no torchrun
    assert one.returncode != 0 and "written by 2 process(es), this run has 1" in one.stderr
