"""The Evaluator's setup without a model: what `__init__` reads and hands on, how
`_draw_examples` draws and hashes the suite's examples, `build_engine`, `kv_scales` and
`tasks`.

The checkpoint, the config, the tokenizer, the engine and the drawing of needles and
structured items are stand-ins; each stand-in binds its call to the real function's
signature (`inspect.signature(real).bind`), so a call with a missing, extra or misnamed
argument fails as it would against the real one, and records the arguments for the test to
check. The fidelity windows, the token stream, the dataset split and the hash are the real
functions', compared with an independent draw of the same seed. Milliseconds a test.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tenantq.engine import Engine as RealEngine
from tenantq.evals import data, needle_grid, structured, windows
from tenantq.evals import evaluator as ev
from tenantq.evals.calibrated import Calibrator
from tenantq.evals.needle_grid import NeedleItem
from tenantq.evals.structured import StructuredItem
from tenantq.evals.suite import FidelitySpec, GateSpec, NeedleSpec, StructuredSpec, Suite
from tenantq.evals.tasks import FidelityTask, PassFailTask
from tenantq.model import config as model_config
from tenantq.model import loader, tokenizer
from tenantq.quant.calibration_set import CalibrationData

CONTEXT = 128  # the stand-in model's positions
ANSWER = 3  # tokens of every stand-in needle's answer
TEXT = "\n".join(f"line {k}: the quick brown fox jumps over the lazy dog {k}" for k in range(40))


def _bind(real, *args, **kwargs) -> dict:
    """The call's arguments by name, defaults filled in; a TypeError where the real function
    would refuse the call."""
    bound = inspect.signature(real).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


class _CharTok:
    """One id per character (ASCII), BOS 1 and EOS 2."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)

    def token_id(self, token: str) -> int | None:
        return {"<|bos|>": 1, "<|eos|>": 2}.get(token)


class _Clock:
    """`time.perf_counter` under the test's control: the stand-ins advance it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _suite(text_path: Path, **update) -> Suite:
    suite = Suite(
        name="setup", seed=5, split="search", resamples=300,
        fidelity=FidelitySpec(source=str(text_path), rows=3, row_tokens=9, top_k=4,
                              tail_samples=4),
        needles=(NeedleSpec(lengths=(40, 48), per_length=2),
                 NeedleSpec(variant="multikey", lengths=(64,), per_length=1)),
        structured=StructuredSpec(tasks=("close_line",), per_task=2, context_tokens=16,
                                  max_new_tokens=4),
        gates=(GateSpec(metric="fidelity.kl_mean", tolerance=0.05, higher_is_better=False),),
    )  # fmt: skip
    return suite.model_copy(update=update) if update else suite


class _Setup:
    """Stand-ins for everything `Evaluator.__init__` reaches outside the evaluator, each
    recording its calls; `make()` builds an Evaluator over them."""

    def __init__(self, tmp_path: Path, monkeypatch) -> None:
        self.tmp_path, self.calls = tmp_path, {}
        self.text = tmp_path / "docs.txt"
        self.text.write_text(TEXT)
        self.model = tmp_path / "model"
        self.model.mkdir()
        self.tok = _CharTok()
        self.config = SimpleNamespace(
            vocab_size=256, max_position_embeddings=CONTEXT, bos_token_id=1
        )
        self.params = {"embed": np.zeros(3)}
        self.clock = _Clock()
        monkeypatch.setattr(ev.time, "perf_counter", self.clock)
        real_identity = ev.model_identity
        real_from_file = model_config.ModelConfig.from_file
        real_require = tokenizer.require_tokenizer
        real_load = loader.load_params
        real_docs = data.load_documents
        real_needles = needle_grid.build_needles
        real_items = structured.build_items

        def record(name, real, *args, **kwargs):
            self.calls.setdefault(name, []).append(_bind(real, *args, **kwargs))

        def identity(folder):
            record("identity", real_identity, folder)
            return "0123456789abcdef" * 4

        def from_file(path):
            record("config", real_from_file, path)
            return self.config

        def require(folder, vocab_size=None):
            record("tokenizer", real_require, folder, vocab_size)
            return self.tok

        def load(folder, config, *, dtype="bfloat16"):
            record("params", real_load, folder, config, dtype=dtype)
            self.clock.now += 10.0  # reading the checkpoint takes 10 s
            return self.params

        def documents(source, text_field="text"):
            record("documents", real_docs, source, text_field)
            if source == data.REFERENCE_TEST:
                return [TEXT[: len(TEXT) // 2], TEXT[len(TEXT) // 2 :]]
            return real_docs(source, text_field)

        def needles(tok, stream, spec, seed):
            record("needles", real_needles, tok, stream, spec, seed)
            self.clock.now += 100.0  # drawing the needles takes 100 s
            task = needle_grid.TASK_NAMES[spec.variant]
            return [
                NeedleItem(task, f"{task}/len{n}/{k}", n, k / 2, stream[k : k + n].tolist(),
                           np.array([7, 8, 9][:ANSWER]))
                for n in spec.lengths for k in range(spec.per_length)
            ]  # fmt: skip

        def items(tok, docs, spec, seed):
            record("structured", real_items, tok, docs, spec, seed)
            return [
                StructuredItem(task, f"structured/{task}/{k}", [1, 40 + k, 41 + t], "f(", "")
                for t, task in enumerate(spec.tasks) for k in range(spec.per_task)
            ]  # fmt: skip

        monkeypatch.setattr(ev, "model_identity", identity)
        monkeypatch.setattr(model_config.ModelConfig, "from_file", from_file)
        monkeypatch.setattr(tokenizer, "require_tokenizer", require)
        monkeypatch.setattr(loader, "load_params", load)
        monkeypatch.setattr(data, "load_documents", documents)
        monkeypatch.setattr(needle_grid, "build_needles", needles)
        monkeypatch.setattr(structured, "build_items", items)

    def make(self, suite=None, **kw) -> ev.Evaluator:
        suite = _suite(self.text) if suite is None else suite
        return ev.Evaluator(self.model, suite, cache_dir=self.tmp_path / "cache", **kw)


@pytest.fixture
def setup(tmp_path, monkeypatch) -> _Setup:
    return _Setup(tmp_path, monkeypatch)


def test_setup_reads_the_checkpoint_once_through_each_loader(setup) -> None:
    calib = CalibrationData(data="calib.txt", sequences=3, sequence_tokens=32)
    me = setup.make(engine_options={"dtype": "float32", "pool_bytes": 1 << 20}, progress=True,
                    calibration=calib)  # fmt: skip
    c = setup.calls
    assert c["identity"] == [{"folder": setup.model}]
    assert c["config"] == [{"path": setup.model}]
    # the tokenizer is checked against the model's vocabulary (its ids index the embedding)
    assert c["tokenizer"] == [{"folder": setup.model, "vocab_size": 256}]
    # float32 host params: each plan quantizes its own copy, whatever the engine's dtype
    assert c["params"] == [{"folder": setup.model, "config": setup.config, "dtype": ev.jnp.float32}]
    assert me.model_path == setup.model and isinstance(me.model_path, Path)
    assert me.identity == "0123456789abcdef" * 4
    assert me.config is setup.config and me.tokenizer is setup.tok and me.params is setup.params
    assert me.cache_dir == setup.tmp_path / "cache" and isinstance(me.cache_dir, Path)
    assert me.progress is True
    # the calibrator holds this model, its params and the caller's calibration set
    cal = me.calibrator
    assert isinstance(cal, Calibrator)
    assert (cal.model_path, cal.config, cal.tokenizer, cal.params, cal.model_id) == (
        setup.model, setup.config, setup.tok, setup.params, me.identity
    )  # fmt: skip
    assert cal.data is calib and cal.cache_dir == setup.tmp_path / "cache" / "calibration"
    # nothing measured yet
    assert me._baseline is None and me._kv_scales == {} and me._evaluations == 0


def test_setup_takes_the_dtype_out_of_the_engine_options_without_touching_the_callers(
    setup,
) -> None:
    options = {"dtype": "float32", "pool_bytes": 1 << 20, "tp": 1}
    me = setup.make(engine_options=options)
    assert me.dtype == "float32" and me.engine_options == {"pool_bytes": 1 << 20, "tp": 1}
    assert options == {"dtype": "float32", "pool_bytes": 1 << 20, "tp": 1}  # the caller's
    plain = setup.make()
    # bf16 unless told: the dtype the suite's baseline is defined in
    assert plain.dtype == "bfloat16" and plain.engine_options == {} and plain.progress is False
    assert plain.calibrator.data == CalibrationData()


def test_the_load_time_spans_reading_the_checkpoint_and_drawing_the_examples(setup) -> None:
    # the stand-ins take 10 s to read the params and 100 s per needle spec drawn (two)
    me = setup.make()
    assert me.load_s == pytest.approx(10.0 + 2 * 100.0)


def test_a_suite_given_by_path_is_loaded(setup) -> None:
    path = setup.tmp_path / "s.toml"
    path.write_text(
        f'name = "from-file"\nseed = 5\n[fidelity]\nsource = "{setup.text}"\nrows = 3\n'
        "row_tokens = 9\n"
    )
    for given in (str(path), path):
        me = setup.make(suite=given)
        assert me.suite.name == "from-file" and me.suite.fidelity.rows == 3
        assert me.fidelity_rows.shape == (3, 9)


def test_fidelity_rows_are_the_seeded_bos_windows_of_the_suites_split(setup) -> None:
    me = setup.make()
    docs = data.split_documents([TEXT], "search")  # one .txt document: its first half
    assert me.docs == docs
    assert setup.calls["documents"] == [{"source": str(setup.text), "text_field": "text"}]
    stream = windows.token_stream(setup.tok, docs)
    want = windows.bos_windows(stream, setup.config, 3, 9, np.random.default_rng([5, 0]))
    np.testing.assert_array_equal(me.fidelity_rows, want)
    assert me.fidelity_rows.dtype == np.int32 and me.fidelity_rows.shape == (3, 9)
    assert (me.fidelity_rows[:, 0] == 1).all()  # BOS first
    confirm = setup.make(suite=_suite(setup.text, split="confirm"))
    assert confirm.docs == data.split_documents([TEXT], "confirm") != docs


def test_fidelity_reads_the_suites_text_field(setup) -> None:
    path = setup.tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"document {k} {TEXT[:200]}"}) for k in range(4)))
    suite = _suite(setup.text)
    spec = suite.fidelity.model_copy(update={"source": str(path), "text_field": "body"})
    me = setup.make(suite=suite.model_copy(update={"fidelity": spec}))
    assert setup.calls["documents"] == [{"source": str(path), "text_field": "body"}]
    assert me.docs == [f"document {k} {TEXT[:200]}" for k in (0, 2)]  # the search half


def test_without_fidelity_the_needles_draw_from_the_reference_test_split(setup) -> None:
    suite = _suite(setup.text, fidelity=None, gates=())
    me = setup.make(suite=suite)
    assert setup.calls["documents"] == [{"source": data.REFERENCE_TEST, "text_field": "text"}]
    assert me.fidelity_rows is None and me.fidelity_kv_tokens is None
    assert me.docs == [TEXT[: len(TEXT) // 2]]  # even documents: the search half
    assert "fidelity.kl_mean" not in me.expected_metrics()


def test_needles_of_every_spec_are_drawn_from_the_whole_stream_with_the_suites_seed(
    setup,
) -> None:
    me = setup.make()
    stream = windows.token_stream(setup.tok, me.docs)
    drawn = setup.calls["needles"]
    assert [d["spec"] for d in drawn] == list(me.suite.needles)
    for d in drawn:
        assert d["tokenizer"] is setup.tok and d["seed"] == 5
        np.testing.assert_array_equal(d["stream"], stream)
    # both specs' items, in the suite's order
    assert [i.example_id for i in me.needle_items] == [
        "needle/len40/0", "needle/len40/1", "needle/len48/0", "needle/len48/1",
        "needle_multikey/len64/0",
    ]  # fmt: skip


def test_structured_items_are_drawn_from_the_split_documents_with_the_suites_seed(
    setup,
) -> None:
    me = setup.make()
    (drawn,) = setup.calls["structured"]
    assert drawn["tokenizer"] is setup.tok and drawn["docs"] == me.docs
    assert drawn["spec"] is me.suite.structured and drawn["seed"] == 5
    assert [i.example_id for i in me.structured_items] == [
        "structured/close_line/0", "structured/close_line/1"
    ]  # fmt: skip
    bare = setup.make(suite=_suite(setup.text, structured=None))
    assert bare.structured_items == [] and len(setup.calls["structured"]) == 1


def test_the_dataset_hash_covers_the_fidelity_rows_and_every_prompt(setup) -> None:
    me = setup.make()
    stream = windows.token_stream(setup.tok, me.docs)
    prompts = [np.asarray(i.prompt, np.int32) for i in me.needle_items + me.structured_items]
    # the hash of the arrays (dtype, shape, bytes) in order: stream[:0] stands for "no
    # fidelity" so a suite without it still hashes its prompts
    assert me.dataset_hash == data.array_hash(stream[:0], me.fidelity_rows, *prompts)
    assert len(prompts) == 5 + 2
    bare = setup.make(suite=_suite(setup.text, fidelity=None, gates=(), structured=None))
    bare_stream = windows.token_stream(setup.tok, bare.docs)
    bare_prompts = [np.asarray(i.prompt, np.int32) for i in bare.needle_items]
    assert bare.dataset_hash == data.array_hash(bare_stream[:0], *bare_prompts)


def test_the_step_shape_is_set_from_the_drawn_examples(setup) -> None:
    me = setup.make()
    # the longest needle feeds 64 + 3 - 1 = 66 tokens: window 128, 8 x fidelity's own 16
    assert (me.step_tokens, me.kv_window_tokens, me.fidelity_kv_tokens) == (None, 128, 16)
    short = setup.make(suite=_suite(setup.text, needles=(NeedleSpec(lengths=(40,), per_length=1),)))
    # 40 + 3 - 1 = 42: window 64 = 4 x 16, shared with fidelity in 9-token steps
    assert (short.step_tokens, short.kv_window_tokens, short.fidelity_kv_tokens) == (9, 64, 64)


def test_a_needle_whose_answer_runs_past_the_context_is_refused(setup) -> None:
    # prompt + answer may fill the context exactly: 125 + 3 = 128
    fits = _suite(setup.text, needles=(NeedleSpec(lengths=(CONTEXT - ANSWER,), per_length=1),))
    assert setup.make(suite=fits).needle_items[0].length == 125
    over = _suite(setup.text, needles=(NeedleSpec(lengths=(CONTEXT - ANSWER + 1,),
                                                  per_length=1),))  # fmt: skip
    with pytest.raises(ValueError) as err:
        setup.make(suite=over)
    assert str(err.value) == (
        "needle at 126 tokens needs 3 more to answer, past the model's context of 128; use "
        "lengths <= 125"
    )


def test_the_suite_is_checked_against_the_model_before_its_weights_are_read(setup) -> None:
    suite = _suite(setup.text)
    long_rows = suite.fidelity.model_copy(update={"row_tokens": CONTEXT + 1})
    with pytest.raises(ValueError, match=r"row_tokens = 129 exceeds the model's context of 128"):
        setup.make(suite=suite.model_copy(update={"fidelity": long_rows}))
    assert "params" not in setup.calls


def test_a_gate_on_a_metric_the_drawn_examples_do_not_measure_is_refused(setup) -> None:
    # model_copy skips the suite's own validation: the evaluator's check still stands
    suite = _suite(setup.text)
    gate = GateSpec(metric="needle.acc_delta.len999", tolerance=0.1, higher_is_better=True)
    with pytest.raises(ValueError, match=r"gates 'needle.acc_delta.len999', which it does not"):
        setup.make(suite=suite.model_copy(update={"gates": (gate,)}))


def test_the_tasks_run_fidelity_then_needles_then_structured_over_the_drawn_examples(
    setup, monkeypatch
) -> None:
    me = setup.make()
    fid, needles, struct = me.tasks()
    assert isinstance(fid, FidelityTask)
    assert fid.rows is me.fidelity_rows and fid.kv_tokens == me.fidelity_kv_tokens == 16
    assert (fid.resamples, fid.seed, fid.phase, fid.steps) == (300, 5, "fidelity", 1)
    assert isinstance(needles, PassFailTask) and isinstance(struct, PassFailTask)
    assert (needles.phase, needles.group, needles.offset) == ("needles", "len", 0)
    assert needles.items is me.needle_items and needles.passed is needle_grid.score
    assert needles.steps == 2  # one progress step per needle spec
    assert needles.generate.__func__ is ev.Evaluator._needles and needles.generate.__self__ is me
    assert (struct.phase, struct.group, struct.offset, struct.steps) == ("structured", "task", 5,
                                                                          1)  # fmt: skip
    assert struct.items is me.structured_items
    assert struct.generate.__func__ is ev.Evaluator._structured
    seen = []

    def score(item, gen, tok):
        seen.append((item, gen, tok))
        return True

    monkeypatch.setattr(structured, "score", score)
    assert struct.passed("item", "gen") is True
    assert seen == [("item", "gen", setup.tok)]  # scored with the model's tokenizer
    only_needles = setup.make(suite=_suite(setup.text, fidelity=None, gates=(), structured=None))
    assert [t.phase for t in only_needles.tasks()] == ["needles"]
    only_fid = setup.make(suite=_suite(setup.text, needles=(), structured=None))
    assert [t.phase for t in only_fid.tasks()] == ["fidelity"]


class _Engine:
    """Stands in for `tenantq.engine.Engine`: records its arguments bound to the real one."""

    built: list[dict] = []
    error: Exception | None = None

    def __init__(self, *args, **kwargs) -> None:
        _Engine.built.append(_bind(RealEngine.__init__, self, *args, **kwargs))
        if _Engine.error is not None:
            raise _Engine.error


class _Calibrator:
    """`prepared(plan)` -> (params to run, folded params, their identity)."""

    def __init__(self) -> None:
        self.data = CalibrationData(data="calib.txt")
        self.plans = []

    def prepared(self, plan):
        self.plans.append(plan)
        return {"run": 1}, {"folded": 1}, "folded-id"


def _engine_me(setup, monkeypatch, **options):
    import tenantq.engine

    _Engine.built, _Engine.error = [], None
    monkeypatch.setattr(tenantq.engine, "Engine", _Engine)
    me = setup.make(engine_options={"dtype": "float16", **options})
    me.calibrator = _Calibrator()
    return me


def test_an_engine_is_built_for_the_plan_with_the_evaluators_settings(setup, monkeypatch):
    from tenantq.quant.plan import QuantPlan

    me = _engine_me(setup, monkeypatch, pool_bytes=1 << 20)
    plan = QuantPlan()
    engine = me.build_engine(plan)
    assert isinstance(engine, _Engine) and me.calibrator.plans == [plan]
    (args,) = _Engine.built
    assert args["config"] is setup.config and args["params"] == {"run": 1}
    assert args["plan"] is plan and args["dtype"] == "float16" and args["tokenizer"] is setup.tok
    assert args["pool_options"] == {"pool_bytes": 1 << 20}
    assert me.engine_options == {"pool_bytes": 1 << 20}  # not grown by the call


def test_a_plan_with_static_kv_scales_gets_them_calibrated_on_its_folded_params(setup, monkeypatch):
    from tenantq.quant.plan import KVPlan, QuantPlan

    plan = QuantPlan(kv=KVPlan(key_format="int8", key_axis="tensor", value_format="int8"))
    assert plan.needs_kv_scales
    me = _engine_me(setup, monkeypatch)
    asked = []
    monkeypatch.setattr(me, "kv_scales", lambda folded, fid: asked.append((folded, fid)) or "S")
    me.build_engine(plan)
    assert asked == [({"folded": 1}, "folded-id")]
    assert _Engine.built[0]["pool_options"] == {"kv_scales": "S"}
    assert "kv_scales" not in me.engine_options
    # scales the caller gave win: none calibrated
    given = _engine_me(setup, monkeypatch, kv_scales="given")
    monkeypatch.setattr(given, "kv_scales", lambda *a: pytest.fail("calibrated"))
    given.build_engine(plan)
    assert _Engine.built[0]["pool_options"] == {"kv_scales": "given"}
    # a plan without static KV axes needs none
    plain = _engine_me(setup, monkeypatch)
    monkeypatch.setattr(plain, "kv_scales", lambda *a: pytest.fail("calibrated"))
    plain.build_engine(QuantPlan())
    assert _Engine.built[0]["pool_options"] == {}


@pytest.mark.parametrize("error", [TypeError("bad option 'x'"), NotImplementedError("no fp4")])
def test_an_engine_the_plan_cannot_build_is_a_one_line_value_error(
    setup, monkeypatch, error
) -> None:
    from tenantq.quant.plan import QuantPlan

    me = _engine_me(setup, monkeypatch)
    _Engine.error = error
    with pytest.raises(ValueError) as err:
        me.build_engine(QuantPlan())
    assert str(err.value) == f"cannot build the engine for this plan: {error}"
    assert err.value.__cause__ is None and err.value.__suppress_context__
    _Engine.error = RuntimeError("other")  # anything else is not the plan's fault: as it is
    with pytest.raises(RuntimeError, match="other"):
        me.build_engine(QuantPlan())


def test_kv_scales_are_calibrated_once_per_folded_identity(setup, monkeypatch) -> None:
    from tenantq.engine.sharding import on_every_host
    from tenantq.quant import kv_calibration as kvc

    real_windows, real_scales = windows.calibration_windows, kvc.kv_static_scales
    drawn, scaled = [], []
    rows = np.arange(12, dtype=np.int32).reshape(2, 6)

    def calibration_windows(*args, **kwargs):
        drawn.append(_bind(real_windows, *args, **kwargs))
        return rows, rows[:0]

    def kv_static_scales(*args, **kwargs):
        scaled.append(_bind(real_scales, *args, **kwargs))
        return f"scales-{len(scaled)}"

    monkeypatch.setattr(windows, "calibration_windows", calibration_windows)
    monkeypatch.setattr(kvc, "kv_static_scales", kv_static_scales)
    me = setup.make()
    me.calibrator = _Calibrator()
    folded = {"w": 1}
    assert me.kv_scales(folded, "f1") == "scales-1"
    assert me.kv_scales(folded, "f1") == "scales-1" and len(scaled) == 1  # once
    assert me.kv_scales({"w": 2}, "f2") == "scales-2" and len(scaled) == 2
    d = drawn[0]
    # the weights' calibration text, the KV defaults, the windows no longer than the model's
    # context (128 < 512)
    assert d["tokenizer"] is setup.tok and d["config"] is setup.config
    assert d["source"] == "calib.txt"
    assert d["num_sequences"] == kvc.DEFAULT_KV_SEQUENCES
    assert d["seq_tokens"] == CONTEXT < kvc.DEFAULT_KV_SEQ_TOKENS
    s = scaled[0]
    assert s["model_path"] == setup.model and s["windows"] is rows
    assert s["model_id"] == "f1" and s["data_hash"] == data.array_hash(rows)
    assert s["cache_dir"] == setup.tmp_path / "cache" / "calibration"
    assert s["params"] is folded and s["agree"] is on_every_host
    assert scaled[1]["model_id"] == "f2" and scaled[1]["params"] == {"w": 2}
    setup.config.max_position_embeddings = 4096  # a long context: the default window
    long_me = setup.make()
    long_me.calibrator = _Calibrator()
    long_me.kv_scales(folded, "f3")
    assert drawn[-1]["seq_tokens"] == kvc.DEFAULT_KV_SEQ_TOKENS == 512
