"""The CLI in pipes and odd places, and its small courtesies (issue 29): usage, --version, one line per failure,
"wrote FILE", a bad plan refused before torch is imported, Ctrl-C, broken pipes, a full disk, the status line."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshplan.cli.main import main
from meshplan.cli.progress import Progress
from meshplan.version import __version__

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
BAD_PLAN = "layout: {tp: 2}\ntensor_parallel:\n  rules:\n    'layers.*.attention.wq': {style: colwize}\n"


def _cli(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "meshplan", *argv], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300, **kw)


def test_bare_command_prints_usage_and_version(capsys):
    assert main([]) == 0  # the help, as pip prints it (an error would have to be one line)
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: meshplan [-h] [--version] COMMAND") and "estimate" in out
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"meshplan {__version__}\n"


def test_subcommand_error_names_the_command_once(capsys):
    assert main(["estimate"]) == 2
    err = capsys.readouterr().err
    assert err == ("meshplan: error: estimate: the following arguments are required: plan, --world-size, --seq, "
                   "--global-batch\n")


def test_output_file_is_announced(tmp_path, capsys):
    out = tmp_path / "ranks.txt"
    assert main(["ranks", "--world-size", "8", "--tp", "2", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"meshplan: wrote {out} ({out.stat().st_size:,} bytes)\n"


def test_factory_raising_a_base_exception_is_one_line(tmp_path, capsys):
    (tmp_path / "skipper.py").write_text("class Skip(BaseException):\n    pass\n\n\n"
                                         "def build():\n    raise Skip('not today')\n")
    code = main(["check", "plans/llama.yaml", "--model", "skipper:build", "--path", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err == "meshplan: error: --model 'skipper:build': the factory failed: Skip: not today\n"


def test_bad_plan_is_refused_before_torch_is_imported(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD_PLAN)
    code = ("import sys, time\nt = time.perf_counter()\nfrom meshplan.cli.main import main\n"
            f"rc = main(['check', {str(tmp_path / 'bad.yaml')!r}, '--model', 'examples.llama:build'])\n"
            "print(rc, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.stdout == "2 False\n", r
    assert r.stderr.startswith("meshplan: error: ") and "'colwize'" in r.stderr and r.stderr.count("\n") == 1


def test_broken_pipe_is_quiet():
    read, write = os.pipe()
    os.close(read)  # the reader is gone before meshplan writes: `meshplan ranks … | true`
    try:
        r = subprocess.run([sys.executable, "-m", "meshplan", "ranks", "--world-size", "4096"], cwd=ROOT, env=ENV,
                           stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="Linux's /dev/full")
def test_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "meshplan", "ranks", "--world-size", "8", "--tp", "2"], cwd=ROOT, env=ENV,
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert (r.returncode, r.stderr) == (2, "meshplan: error: cannot write standard output: No space left on device\n")


def test_ctrl_c_during_the_imports_is_one_line(tmp_path):
    """SIGINT once the subcommands' imports began (``-X importtime`` says so), while the model's module is being
    imported: never a traceback, exit 130. The module blocks until the signal comes, so a slow machine cannot let
    the command finish first."""
    (tmp_path / "blocking_model.py").write_text(
        "import os, sys\nos.write(2, b'blocking-model-ready\\n')\nsys.stdin.read()\n")  # fd 2: the CLI captures sys.stderr
    env = {**ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "meshplan", "check", "plans/llama.yaml",
                          "--model", "blocking_model:build"], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         # a terminal's Ctrl-C: a shell's background job starts with SIGINT ignored, and so would
                         # the command (Python installs no handler for an ignored SIGINT)
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in p.stderr:
        lines.append(line)
        if line.rstrip() == "blocking-model-ready":
            p.send_signal(signal.SIGINT)
            break
    rest = p.communicate(timeout=300)[1]  # closes stdin: a missed signal ends in exit 0, not a hang
    assert p.returncode == 130
    assert any(x.rstrip().endswith("meshplan.cli.args") for x in lines), "the signal came before the CLI's imports"
    ours = [x for x in rest.splitlines() if not x.startswith("import time:")]
    assert ours == ["meshplan: error: interrupted"], rest[-3000:]


class _Tty:
    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_status_line_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("MESHPLAN_PROGRESS", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    tty = _Tty()
    with Progress("meshplan solve", tty) as p:
        p.stage("searching")
        deadline = time.monotonic() + 120
        while "searching" not in tty.text and time.monotonic() < deadline:  # drawn after DELAY_S (1 s)
            time.sleep(0.05)
        sys.stderr.write("meshplan: warning: x\n")  # erases the status line first
    assert re.match(r"\r\x1b\[Kmeshplan solve: searching… \d+ s", tty.text), tty.text
    assert "\r\x1b[Kmeshplan: warning: x\n" in tty.text
    assert tty.text.rsplit("\n", 1)[1] in ("", "\r\x1b[K") or tty.text.endswith("\r\x1b[K")  # erased at the end
    quiet = _Tty()
    quiet.isatty = lambda: False
    with Progress("meshplan solve", quiet):
        time.sleep(1.3)
    assert quiet.text == ""


def test_check_takes_a_checkpoint_folder_as_convert_does(tmp_path, capsys):
    """``check --model DIR``: the folder's config.json built as its architecture (convert reads the same folder)."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,'
        ' "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256}')
    assert main(["check", "plans/hf_llama.yaml", "--model", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("meshplan check: plans/hf_llama.yaml  model LlamaForCausalLM  tp=2")
    assert main(["check", "plans/hf_llama.yaml", "--model", str(tmp_path), "--config", '{"num_hiden_layers": 1}']) == 2
    assert "'num_hiden_layers' (did you mean num_hidden_layers" in capsys.readouterr().err
    assert main(["check", "plans/hf_llama.yaml", "--model", str(tmp_path.parent)]) == 2
    assert capsys.readouterr().err.endswith("a folder without config.json; expected a transformers checkpoint folder "
                                            "or MODULE:FACTORY\n")


def test_export_into_a_file_or_under_one_is_one_line(tmp_path, capsys):
    """``export CKPT OUT`` where OUT is a file, or under one: one line, exit 2; a missing parent folder is made."""
    import warnings

    import torch

    import llama
    import meshplan
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    meshplan.save(tmp_path / "ck" / "step-00000001", llama.build(llama.tiny_args()), step=1)
    (tmp_path / "afile").write_text("x")
    for out, why in [("afile", "File exists"), ("afile/sub", "Not a directory")]:
        assert main(["export", str(tmp_path / "ck"), str(tmp_path / out)]) == 2
        assert capsys.readouterr().err == f"meshplan: error: {tmp_path / out}: cannot create the output folder: {why}\n"
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "new" / "deeper")]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == f"{tmp_path / 'new' / 'deeper' / 'model.safetensors'}\n"
