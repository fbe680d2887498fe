"""The harness of the pyxfer.all_gather group tests: the case registry, the helpers cases share
(inputs identical on every rank, bit-exact comparisons, expected warnings), and ``run_group``, which
spawns one gather_worker.py process per rank (and ``spawn_cases``, which the Transformer Engine group
tests use with their own worker, te_worker.py).

A case is ``(name, fn)``; ``fn(ctx)`` runs on every rank of the group (``ctx``: rank, world, device,
group, a per-case generator) and raises on failure. Case modules (gather_cases_*.py) each define
``cases(world)``; ``cases(world)`` here concatenates them in a fixed order, so that the i-th case
draws the same inputs on every rank. Inputs are made on the CPU from a per-case seed shared by every
rank, moved to the rank's device; expected results are computed on the CPU in one process (quantize
the full tensor), so a GPU run also checks CUDA == CPU bit-exactness of every gathered buffer.
"""
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist

import pyxfer.gather
import pyxfer.gather.errors
from pyxfer.gather import GatherHandle, QuantizedGatherFallbackWarning, all_gather

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # on the workers' sys.path, for ``import support.<module>``
CASE_MODULES = ("support.gather_cases_plain", "support.gather_cases_formats", "support.gather_cases_errors",
                "support.gather_cases_fused")
SPAWN_TIMEOUT_S = 240

HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
USAGES = ((True, False), (False, True), (True, True))
PLAIN_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]
# Shard shapes per format: quantizable ones, and ones that are not (M or K off the block).
QUANTIZABLE = {"fp8_block_1x128": [(128, 256), (2, 64, 128)], "fp8_block_128x128": [(128, 384), (256, 128)],
               "mxfp8": [(32, 64), (2, 16, 96)], "nvfp4": [(16, 64), (2, 8, 32)]}
NOT_QUANTIZABLE = {"fp8_block_1x128": [(64, 256), (128, 96)], "fp8_block_128x128": [(32, 128), (3, 20, 256)],
                   "mxfp8": [(16, 64), (8, 48)], "nvfp4": [(8, 32), (24, 40)]}


class Ctx:
    def __init__(self, rank, world, device, seed, group=None):
        self.rank, self.world, self.device, self.seed, self.group = rank, world, device, seed, group
        self.case_index = 0
        self.fresh = None  # run before each case (run_cases): every case starts from waiting calls

    def gen(self):
        return torch.Generator().manual_seed(self.seed * 1000003 + self.case_index)


# ---- data and comparisons --------------------------------------------------------------------

def full_tensor(ctx, shard_shape, dtype, gen, spread=False):
    """The full (W*d0, ...) tensor, identical on every rank (CPU). ``spread``: each shard gets its own
    magnitude (so NVFP4 shard amaxes differ)."""
    shape = (ctx.world * shard_shape[0],) + tuple(shard_shape[1:])
    x = torch.randn(shape, generator=gen) * 3
    if spread:
        x = x * torch.arange(1, ctx.world + 1, dtype=torch.float32).repeat_interleave(shard_shape[0]).reshape(
            (-1,) + (1,) * (len(shape) - 1))
    return x.to(dtype)


def shard_of(ctx, full, rank=None):
    rank = ctx.rank if rank is None else rank
    d0 = full.shape[0] // ctx.world
    return full[rank * d0:(rank + 1) * d0]


def noncontig(t):
    """Same values, reversed memory layout (not contiguous for >= 2 dims)."""
    if t.dim() < 2:
        u = torch.empty((t.numel(), 2), dtype=t.dtype, device=t.device)[:, 0].reshape(t.shape)
        u.copy_(t)
        return u
    u = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).permute(*reversed(range(t.dim())))
    u.copy_(t)
    return u  # contiguous only where every dim but one has size 1


def qt_noncontig(q):
    """The same QuantizedTensor with every >= 2-D buffer non-contiguous."""
    return q._rebuild(**{n: noncontig(b) if b.dim() >= 2 else b for n, b in q.buffers().items()})


def raw(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def assert_same(got, want, what=""):
    """Bit-exact: same kind, shape, dtype; QuantizedTensors: same class, options, and every buffer."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
        assert got.shape == want.shape and got.dtype == want.dtype, \
            f"{what}: got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
        assert torch.equal(raw(got), raw(want)), f"{what}: values differ"
        return
    assert type(got) is type(want), f"{what}: got {type(got).__name__}, expected {type(want).__name__}"
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: shape/dtype {got.shape} {got.dtype}"
    assert got.options == want.options, f"{what}: options {got.options} != {want.options}"
    gb, wb = got.buffers(), want.buffers()
    assert sorted(gb) == sorted(wb), f"{what}: buffers {sorted(gb)} != {sorted(wb)}"
    for name in wb:
        assert gb[name].shape == wb[name].shape and gb[name].dtype == wb[name].dtype, \
            f"{what}: {name} {tuple(gb[name].shape)} {gb[name].dtype} != {tuple(wb[name].shape)} {wb[name].dtype}"
        assert torch.equal(raw(gb[name]), raw(wb[name])), f"{what}: {name} bytes differ"
        assert gb[name].device == got.device


def gather(ctx, x, *, async_op=False, **kw):
    """all_gather, through the handle when async (checking it is a GatherHandle)."""
    out = all_gather(x, ctx.group, async_op=async_op, **kw)
    if async_op:
        assert isinstance(out, GatherHandle), type(out)
        out = out.wait()
    return out


@contextlib.contextmanager
def expect_warning(expected, contains=()):
    pyxfer.gather.errors._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours = [w for w in caught if issubclass(w.category, QuantizedGatherFallbackWarning)]
    if not expected:
        assert not ours, f"unexpected fallback warning: {ours[0].message}"
        return
    assert len(ours) == 1, f"expected one QuantizedGatherFallbackWarning, got {[str(w.message) for w in ours]}"
    assert ours[0].filename == os.path.abspath(__file__) or ours[0].filename == __file__, ours[0].filename
    for text in contains:
        assert text in str(ours[0].message), f"{text!r} not in {ours[0].message}"


def nvfp4_opts(fmt, full):
    return {"global_amax": float(full.float().abs().max())} if fmt == "nvfp4" else {}



def group_of(ctx):
    return ctx.group or dist.group.WORLD


def state(ctx):
    """The group's engine state on this rank (pyxfer.gather internals): ``period`` (None: waiting calls),
    ``predicted()``, ``history``."""
    return pyxfer.gather.engine.state_of(group_of(ctx), ctx.rank, ctx.world)


def fused(ctx) -> bool:
    """Whether the group's next call runs fused if its signature is the predicted one."""
    predicted = state(ctx).predicted()
    return predicted is not None and predicted.fusable


def fresh(ctx):
    """Every rank at the same point: raise what is pending (check_gathers), then forget the group's
    schedule, so that the next call is a waiting call whatever the calls before did."""
    pyxfer.check_gathers(ctx.group)
    state(ctx).reset()


def in_step(ctx):
    """A plain gather with exact results: the group is still in step."""
    y = torch.full((2,), float(ctx.rank), device=ctx.device)
    assert_same(all_gather(y, ctx.group), torch.arange(ctx.world).float().repeat_interleave(2))


@contextlib.contextmanager
def scratch_posts():
    """Counts this rank's posts of scratch buffers (a call that left the group's schedule, or failed
    before or after agreeing): one entry per post, the number of parts of the plan it mirrors."""
    seen, original = [], pyxfer.gather.engine.post

    def counting(group, plan, inputs, meta, amax, latch, seq, wait_seq, mode):
        if mode & pyxfer.gather.engine.MODE_SCRATCH:
            seen.append(len(pyxfer.gather.engine.plan_by_id(plan).layout))
        return original(group, plan, inputs, meta, amax, latch, seq, wait_seq, mode)
    pyxfer.gather.engine.post = counting
    try:
        yield seen
    finally:
        pyxfer.gather.engine.post = original


def reachable(root, limit=200_000) -> list:
    """The objects reachable from ``root`` through tracebacks, frames' locals, closures, containers and
    instance attributes (not through modules, classes, functions' globals or tensors' storage)."""
    import types
    caller = sys._getframe(1)  # executing: its locals hold root (not a reference of root's)
    seen, out, todo = {id(root), id(caller)}, [], [root]
    while todo and len(out) < limit:
        obj = todo.pop()
        if isinstance(obj, BaseException):
            nxt = [obj.__traceback__, obj.__context__, obj.__cause__, *obj.args]
        elif isinstance(obj, types.TracebackType):
            nxt = [obj.tb_frame, obj.tb_next]
        elif isinstance(obj, types.FrameType):
            nxt = list(obj.f_locals.values())
        elif isinstance(obj, types.FunctionType):
            nxt = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        elif isinstance(obj, types.MethodType):
            nxt = [obj.__self__]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            nxt = list(obj)
        elif isinstance(obj, dict):
            nxt = list(obj.values())
        elif isinstance(obj, (types.ModuleType, type, torch.Tensor, str, bytes, int, float)) or obj is None:
            nxt = []
        else:
            nxt = list(getattr(obj, "__dict__", {}).values())
            nxt += [getattr(obj, n) for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)]
        for o in nxt:
            if o is root:
                out.append(o)
            if id(o) not in seen:
                seen.add(id(o))
                out.append(o)
                todo.append(o)
    return out


def _filled(cell):
    try:
        return cell.cell_contents is not None or True
    except ValueError:  # an empty cell
        return False


# ---- the case registry and the spawner --------------------------------------------------------

def cases(world):
    out = []
    for name in CASE_MODULES:
        out += importlib.import_module(name).cases(world)
    return out


def case_names(world):
    return [name for name, _ in cases(world)]


def run_group(world, backend="gloo", extra=(), timeout=SPAWN_TIMEOUT_S, seed=None, only=None):
    """Spawn ``world`` worker processes (gather_worker.py) that run the cases named in ``only`` (None:
    every case of ``case_names(world)``); returns (seed, {case: [None or error text per rank]}). A rank
    that died or hung is reported on the first case it did not finish. PYXFER_GATHER_SEED replays a
    failing run's seed."""
    wanted = case_names(world) if only is None else [c for c in case_names(world) if c in set(only)]
    if seed is None:
        seed = int(os.environ.get("PYXFER_GATHER_SEED") or int.from_bytes(os.urandom(4), "little"))
    return seed, spawn_cases(os.path.join(HERE, "gather_worker.py"), world, wanted, seed, timeout,
                             ("--backend", backend, *extra))


def spawn_cases(script, world, wanted, seed, timeout, extra=()):
    """Run ``script`` once per rank of a ``world``-process group (``--rank --world --init --out --seed
    --cases``, then ``extra``), each running the cases named in ``wanted`` (run_cases); returns {case:
    [None or error text per rank]}. A rank that died or hung is blamed on the first case it did not
    finish (with its output's tail), the cases after it marked as not reached."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/init"
        with open(os.path.join(tmp, "cases.json"), "w") as f:
            json.dump(wanted, f)
        # no empty PYTHONPATH entry: that would put the working directory (maybe a source tree
        # without the built extension) ahead of the installed pyxfer
        path = [TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
               "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, script, "--rank", str(r), "--world", str(world), "--init", init,
                                   "--out", tmp, "--seed", str(seed), "--cases", os.path.join(tmp, "cases.json"),
                                   *extra],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for r in range(world)]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outputs.append(p.communicate()[0] + f"\n(killed after {timeout} s)")
        results = {}
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.jsonl")
            records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
            for rec in records:
                results.setdefault(rec["case"], [None] * world)[r] = None if rec["ok"] else rec["error"]
            done = {rec["case"] for rec in records}
            missing = [c for c in wanted if c not in done]
            if missing:  # died or hung: blame the first case it did not finish
                tail = outputs[r][-3000:] if r < len(outputs) else ""
                results.setdefault(missing[0], [None] * world)[r] = f"rank {r} did not finish (seed {seed}):\n{tail}"
                for c in missing[1:]:
                    results.setdefault(c, [None] * world)[r] = f"rank {r} did not get to this case"
        return results


def run_cases(ctx, todo, out, wanted_file, limit=None):
    """The worker side of spawn_cases: run the cases of ``todo`` named in ``wanted_file`` (a JSON list;
    None: all) in registry order (``ctx.case_index`` keeps its registry index, so a case draws the same
    inputs whatever else runs), appending one JSON line per case ({"case", "ok", "error"}) to
    ``out``/rank<R>.jsonl so that a hang is localised. ``limit``: traceback frames kept."""
    wanted = None if wanted_file is None else set(json.load(open(wanted_file)))
    with open(os.path.join(out, f"rank{ctx.rank}.jsonl"), "w") as log:
        for index, (name, fn) in enumerate(todo):
            ctx.case_index = index
            if wanted is not None and name not in wanted:
                continue
            try:
                if ctx.fresh is not None:
                    ctx.fresh(ctx)
                fn(ctx)
                record = {"case": name, "ok": True, "error": None}
            except Exception:
                record = {"case": name, "ok": False, "error": traceback.format_exc(limit=limit)}
            log.write(json.dumps(record) + "\n")
            log.flush()


def selected_cases(request, test_name, **params):
    """The case names of this session's ``test_name[...]`` items whose other parameters are ``params``:
    what the group must run (``pytest -k`` deselects the others before the first item runs)."""
    names = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.originalname == test_name and spec is not None and \
                all(spec.params.get(k) == v for k, v in params.items()):
            names.append(spec.params["case"])
    return names


def assert_case_passed(seed, results, case):
    """Every rank ran ``case`` of a run_group result without an error (else each rank's error)."""
    errors = results.get(case)
    assert errors is not None, f"case {case} did not run (seed {seed})"
    failed = [(r, e) for r, e in enumerate(errors) if e]
    assert not failed, f"seed {seed}: " + "\n".join(f"--- rank {r}:\n{e}" for r, e in failed)
