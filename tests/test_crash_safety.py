"""Crash safety of train.py: a tiny run is SIGKILLed at each write point (through the
FASTCL_CRASH_AT test hook), then resumed. Whatever is on disk after the kill must load and be
one whole export; ``--resume`` must give the uninterrupted run's losses, evaluations and final
export. Damaged checkpoints are refused, naming the file, and never reach the export."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from fastcl import checkpoint, objectives, training
from fastcl.encoders import VERSIONS_DIR, load_encoder, save_sentence_encoder
from fastcl.trainer.logs import read_log
from test_train import ROOT, base_args, step_records, tiny, train  # noqa: F401 (tiny: fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# 8 steps, each evaluated and checkpointed. The cls head is kept at export,
# so the MLP lives in two files (2_Dense/ and the model's pooler) that must agree.
EXTRA = dict(sts_dir=None, eval_steps=1, checkpoint_steps=1, pooler="cls", no_mlp_only_train=True)


def run_args(tiny, out, **more):
    return base_args(tiny, out, "simcse", steps=8, **{**EXTRA, "sts_dir": tiny / "sts", **more})


def exported_state(out):
    """The export in ``out`` as fastcl loads it, after checking its files agree: the head in
    2_Dense/ is the one in the model's own pooler, and transformers loads the model."""
    from transformers import AutoModel

    encoder, _ = load_encoder(out, "cls")
    state = {k: v.clone() for k, v in encoder.state_dict().items()}
    assert torch.equal(state["backbone.pooler.dense.weight"], state["head.dense.weight"])
    assert torch.equal(state["backbone.pooler.dense.bias"], state["head.dense.bias"])
    AutoModel.from_pretrained(out)
    return {k: v for k, v in state.items() if not k.startswith("backbone.pooler.")}


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The uninterrupted run, with the model of every export it made."""
    out = tmp_path_factory.mktemp("reference") / "out"
    exports = []
    real = train.export

    def recording(run):
        real(run)
        with torch.random.fork_rng(devices=[]):  # loading draws random initial weights
            exports.append(exported_state(run.out))
    threads = torch.get_num_threads()  # one thread, as the killed run and the resume
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(train, "export", recording)
            assert train.main(run_args(tiny, out)) == 0
    finally:
        torch.set_num_threads(threads)
    best = [r["step"] for r in read_log(out) if r["type"] == "eval" and r["best"]]
    assert best[:2] == [1, 2], "the test needs exports at steps 1 and 2 (rising dev scores)"
    return out, exports


def run_until_killed(tiny, out, point):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "FASTCL_CRASH_AT": point}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *run_args(tiny, out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:]


def assert_resumed_like(reference, out):
    ref, exports = reference
    a, b = step_records(ref), step_records(out)
    assert [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in a] == \
        [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in b]
    evals = lambda o: [(r["step"], r["stsb-dev"], r["best"]) for r in read_log(o)
                       if r["type"] == "eval"]
    assert evals(ref) == evals(out)
    assert same_state(exported_state(out), exports[-1])
    assert json.loads((out / "train_results.json").read_text()) == \
        json.loads((ref / "train_results.json").read_text())
    leftovers = [p.name for p in out.iterdir() if ".tmp" in p.name or ".link-" in p.name]
    assert not leftovers
    assert sorted(p.name for p in (out / VERSIONS_DIR).iterdir()) == sorted(
        ["current", os.readlink(out / VERSIONS_DIR / "current")])


# Each step exports (before its checkpoint) and then checkpoints; the kills are in step 2.
@pytest.mark.parametrize("point,exported_step", [
    ("checkpoint-write:2", 2),  # half of the step-2 checkpoint written; step 1's is on disk
    ("export-stage:2", 1),      # the step-2 export half staged; step 1's is published
    ("export-publish:2", 1),    # the step-2 export complete beside step 1's, not switched to
    ("export-links:2", 1),      # the top-level links made, the switch not done
])
def test_kill_at_a_write_point_then_resume(tiny, tmp_path, reference, point, exported_step):
    out = tmp_path / "out"
    run_until_killed(tiny, out, point)
    # What a reader finds after the kill: the whole export of one step, its files agreeing.
    _, exports = reference
    assert same_state(exported_state(out), exports[exported_step - 1])
    ckpt = checkpoint.read_checkpoint(out / train.CHECKPOINT)  # the last complete one verifies
    assert ckpt["state"]["step"] == 1
    if point.startswith("checkpoint-write"):
        assert list(out.glob(".checkpoint.pt.tmp-*")), "the kill should leave a partial write"
    assert train.main(run_args(tiny, out, resume=True)) == 0
    assert not list(out.glob(".checkpoint.pt.tmp-*"))
    assert_resumed_like(reference, out)



def test_a_best_export_after_the_checkpoint_stays_the_best_on_resume(tiny, tmp_path, monkeypatch):
    """Killed after step 2's best export but before its checkpoint: the checkpoint names step
    1 as the best. On a GPU the replayed evaluation of step 2 may score lower (here it does,
    on purpose); the export on disk is step 2's, so the state must say so and the replay must
    re-export step 2's model, not leave results and export disagreeing."""
    out = tmp_path / "out"
    run_until_killed(tiny, out, "checkpoint-write:2")
    assert json.loads((out / "fastcl_selection.json").read_text())["step"] == 2
    real = train.dev_evaluation

    def lower_at_2(run):
        res = real(run)
        return {**res, "metric": res["metric"] - 50.0} if run.state["step"] == 2 else res
    monkeypatch.setattr(train, "dev_evaluation", lower_at_2)
    assert train.main(run_args(tiny, out, resume=True)) == 0
    (replayed,) = [r for r in read_log(out) if r["type"] == "eval" and r["step"] == 2]
    assert replayed["best"]
    results = json.loads((out / "train_results.json").read_text())
    selection = json.loads((out / "fastcl_selection.json").read_text())
    assert selection == {"step": results["best_step"], "metric": results["best_metric"]}

def test_sentence_transformers_loads_an_export_published_over_another(tiny, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from fastcl.encoders import MLPHead, load_backbone

    backbone, tokenizer = load_backbone(tiny / "bert")
    torch.manual_seed(0)
    out = tmp_path / "out"
    for _ in range(2):  # the second export replaces the first
        head = MLPHead(32, init_std=0.5)
        save_sentence_encoder(out, backbone, tokenizer, "cls", head)
    encoder, tok = load_encoder(out, "cls")
    assert torch.equal(encoder.head.dense.weight, head.dense.weight)
    model = st.SentenceTransformer(str(out), device="cpu")
    ours = encoder.eval()(**tok(["the cat"], return_tensors="pt")).detach()
    torch.testing.assert_close(torch.as_tensor(model.encode(["the cat"])), ours, atol=1e-5, rtol=1e-5)
    assert len(list((out / VERSIONS_DIR).iterdir())) == 2  # current and one version


def damage(path, how):
    data = path.read_bytes()
    if how == "flipped":
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 64]) + data[mid + 64:])
    elif how == "truncated":
        path.write_bytes(data[:len(data) // 3])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(os.urandom(len(data)))


@pytest.mark.parametrize("how,message", [("flipped", "is damaged: its SHA-256"),
                                         ("truncated", "is truncated"),
                                         ("empty", "is empty"),
                                         ("random", "is not a fastcl checkpoint")])
def test_a_damaged_checkpoint_is_refused_and_the_export_kept(tiny, tmp_path, how, message):
    out = tmp_path / "out"
    args = base_args(tiny, out, "simcse", steps=2, keep_checkpoint=True)  # no --sts-dir: the end exports
    assert train.main(args) == 0
    export = (out / "model.safetensors").read_bytes()
    damage(out / train.CHECKPOINT, how)
    with pytest.raises(SystemExit) as err:
        train.main(args + ["--resume"])
    assert str(out / train.CHECKPOINT) in str(err.value.code) and message in str(err.value.code)
    assert (out / "model.safetensors").read_bytes() == export


def test_stale_temporary_files_are_removed_at_start(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    stale = [out / ".checkpoint.pt.tmp-999999999", out / VERSIONS_DIR / "stage-999999999",
             out / ".train_log.jsonl.tmp"]
    stale[1].mkdir(parents=True)
    stale[0].write_bytes(b"partial")
    stale[2].write_text("{}\n")
    assert train.main(base_args(tiny, out, "simcse", steps=1)) == 0
    assert not any(p.exists() for p in stale)
    assert "left by an interrupted write" in capsys.readouterr().out
