"""``meshplan train`` without processes: its settings, schedule, shape checks, filled plan sections and the bad
inputs it refuses in one line before any process starts."""

import pytest

from meshplan.cli.main import main
from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan
from meshplan.plan_file.training import Schedule
from meshplan.trainer.checks import check_shapes
from meshplan.trainer.schedule import lr_factor
from meshplan.trainer.settings import parse_overrides, setting_names, with_overrides

pytestmark = pytest.mark.fast

BASE = {"model.path": "m", "data.path": "d"}


def _plan(layout=None, **over):
    data = {"version": 1, **({"layout": layout} if layout else {})}
    return with_overrides(Plan.from_data(data, "p.yaml"), {**BASE, **over})


def test_overrides_typed_and_named():
    got = parse_overrides(["--steps", "10", "--optimizer.lr=1e-3", "--optimizer.betas", "[0.9, 0.99]",
                           "--checkpoint.folder", "null", "--global-batch", "4", "--layout.tp", "2"])
    assert got == {"steps": 10, "optimizer.lr": 1e-3, "optimizer.betas": [0.9, 0.99], "checkpoint.folder": None,
                   "global_batch": 4, "layout.tp": 2}
    plan = with_overrides(Plan.from_data({"version": 1}, "p.yaml"), {**BASE, **got})
    assert plan.training.optimizer.betas == (0.9, 0.99) and plan.layout.tp == 2 and plan.training.steps == 10
    assert "optimizer.lr" in setting_names() and "model.path" in setting_names()


@pytest.mark.parametrize("argv, match", [
    (["--lr", "1"], r"unknown setting --lr; did you mean --optimizer.lr\?"),
    (["--steps"], "--steps needs a value"),
    (["steps", "3"], "expected --SETTING VALUE, got 'steps'"),
])
def test_bad_flags(argv, match):
    with pytest.raises(PlanError, match=match):
        parse_overrides(argv)


@pytest.mark.parametrize("over, match", [
    ({"steps": "x"}, r"training.steps \(--steps\): Input should be a valid integer"),
    ({"model.config": "c"}, "give exactly one of path, config, factory; got path, config"),
    ({"eval.every": 5}, "eval.every needs held-out data"),
    ({"schedule.warmup": 100}, r"schedule.warmup \(100\) must be below steps \(100\)"),
    ({"layout.tp": 0}, r"layout.tp \(--layout.tp\)"),
])
def test_bad_values_name_the_flag(over, match):
    with pytest.raises(PlanError, match=match):
        _plan(**over)


def test_no_training_section_says_what_to_give():
    with pytest.raises(PlanError, match="give --model.path .* and --data.path"):
        with_overrides(Plan.from_data({"version": 1}, "p.yaml"), {"steps": 3})


def test_schedule():
    assert [lr_factor(Schedule(warmup=2, decay="linear", min_lr_ratio=0.0), k, 4) for k in (1, 2, 3, 4)] == \
        [0.5, 1.0, 1.0, 0.0]
    cos = [lr_factor(Schedule(decay="cosine", min_lr_ratio=0.1), k, 5) for k in range(1, 6)]
    assert cos[0] == 1.0 and cos[-1] == pytest.approx(0.1) and cos == sorted(cos, reverse=True)
    assert lr_factor(Schedule(warmup=3, decay="constant"), 7, 10) == 1.0


@pytest.mark.parametrize("layout, world, over, match", [
    ({"cp": 2, "tp": 2}, 4, {"seq_len": 30}, r"training.seq_len: sequence length 30 is not divisible by"),
    ({"tp": 2}, 4, {"global_batch": 3}, r"training.global_batch: 3 is not divisible by the 2 data-parallel ranks"),
    ({"tp": 1}, 2, {"global_batch": 6, "microbatches": 4}, r"batch of 3 .* not divisible by 4 microbatches"),
    ({"tp": 4}, 2, {}, r"world"),
])
def test_shapes_refused(layout, world, over, match):
    with pytest.raises(PlanError, match=match):
        check_shapes(_plan(layout, **over), world)


def test_sequence_parallel_seq_len():
    data = {"version": 1, "layout": {"tp": 2},
            "tensor_parallel": {"sequence_parallel": True, "rules": {"x": "colwise"}}}
    plan = with_overrides(Plan.from_data(data, "p.yaml"), {**BASE, "seq_len": 33})
    with pytest.raises(PlanError, match=r"33 is not divisible by tp = 2 .*e.g. 32, 34"):
        check_shapes(plan, 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny transformers folder (llama) with its tokenizer, and a corpus."""
    from tiny_model import make_model, make_tokenizer
    root = tmp_path_factory.mktemp("tiny")
    texts = ["the plan says how to shard " * 40, "and the training section says how to train " * 40]
    tok = make_tokenizer(texts, 300)
    make_model("llama", len(tok), tok.eos_token_id, hidden=16, layers=2).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "corpus").mkdir()
    for i, t in enumerate(texts):
        (root / "corpus" / f"{i}.txt").write_text(t)
    return root


def _cli(capsys, *argv):
    capsys.readouterr()
    code = main(["train", *argv])
    err = capsys.readouterr().err
    return code, err.strip().splitlines()


@pytest.mark.parametrize("case", ["no data", "short corpus", "vocab", "seq_len", "unknown", "no model"])
def test_bad_input_is_one_line_before_any_process(tiny, tmp_path, capsys, case):
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nlayout: {cp: 2, tp: 2}\n")
    args = {"--model.path": str(tiny / "model"), "--data.path": str(tiny / "corpus"), "--seq-len": "16",
            "--global-batch": "2", "--nproc": "4"}
    match = {"no data": "training.data.path: data /nope: no such file or folder",
             "short corpus": "fewer than one global batch of 4096",
             "vocab": "ids but the model's vocabulary has 100 (a tokenizer of another model?)",
             "seq_len": "training.seq_len: sequence length 15 is not divisible by",
             "unknown": "unknown setting --stepz",
             "no model": "training.model.path: /nope: no config.json there"}[case]
    if case == "no data":
        args["--data.path"] = "/nope"
    elif case == "short corpus":
        args["--global-batch"] = "4096"
    elif case == "vocab":
        from tiny_model import make_model
        small = tmp_path / "small"
        make_model("llama", 100, 0, hidden=16, layers=2).save_pretrained(small)
        args["--model.path"], args["--model.tokenizer"] = str(small), str(tiny / "model")
    elif case == "seq_len":
        args["--seq-len"] = "15"
    elif case == "unknown":
        args["--stepz"] = "3"
    else:
        args["--model.path"] = "/nope"
    code, lines = _cli(capsys, str(plan), *[w for kv in args.items() for w in kv])
    assert code == 2 and len(lines) == 1, lines
    assert match in lines[0], lines[0]
