"""`meshplan ranks` / `schema`: formats, seeds, bad input (one line, exit 2)."""

import json
import subprocess
import sys

import pytest

from meshplan.cli.main import main

pytestmark = pytest.mark.fast


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_megatron_seed(capsys):
    code, out, _ = run(capsys, "ranks", "--world-size", "16", "--tp", "4", "--pp", "2", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert data["order"] == "tp-cp-ep-dp-pp" and data["world_size"] == 16
    assert data["sizes"]["dp"] == 2 and data["sizes"]["etp"] == 4 and data["sizes"]["edp"] == 2
    assert data["groups"]["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    kinds = "tp cp dp pp dp-cp tp-pp tp-dp tp-cp tp-dp-cp ep etp edp etp-ep etp-ep-pp embd pos_embd".split()
    assert list(data["groups"]) == kinds
    assert set(data["ranks"][0]) == {"rank", "tp", "cp", "dp", "pp", "etp", "ep", "edp", "tp_rank", "pp_rank",
                                     "rdp_rank", "dp_rank", "mp_rank"}


def test_json_moe_seed(capsys):
    code, out, _ = run(capsys, "ranks", "--world-size", "16", "--tp", "4", "--pp", "2", "--etp", "1", "--ep", "4",
                       "--format", "json")
    data = json.loads(out)
    assert data["groups"]["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert data["groups"]["edp"][4] == [8, 12]


def test_table_smp(capsys):
    code, out, _ = run(capsys, "ranks", "--world-size", "8", "--tp", "2", "--pp", "2", "--order", "DTP")
    assert code == 0
    assert "order pp-tp-dp-cp-ep" in out
    assert "tp-dp      [0,2,4,6] [1,3,5,7]" in out
    row6 = [line for line in out.splitlines() if line.strip().startswith("6 ")][0].split()
    assert row6[-5:] == ["1", "0", "1", "3", "2"]  # tp_rank pp_rank rdp_rank dp_rank mp_rank


def test_svg(capsys):
    code, out, _ = run(capsys, "ranks", "--world-size", "16", "--tp", "4", "--pp", "2", "--format", "svg")
    assert code == 0 and out.startswith("<svg") and out.rstrip().endswith("</svg>")
    assert "tp groups" in out and "rank 13: dp group 5" in out


@pytest.mark.parametrize("argv, message", [
    (["ranks", "--world-size", "16", "--tp", "3"], "tp(3) does not divide world_size(16); valid tp: 1, 2, 4, 8, 16"),
    (["ranks", "--tp", "2"], "the following arguments are required: --world-size"),
    (["ranks", "--world-size", "8", "--tp", "x"], "argument --tp: invalid int value: 'x'"),
    (["ranks", "--world-size", "8", "--order", "tp-xx"], "order: order 'tp-xx' has unknown token(s) ['xx']"),
    (["ranks", "--world-size", "8", "--format", "gif"], "invalid choice: 'gif'"),
    (["nope"], "invalid choice: 'nope'"),
    (["ranks", "--world-size", "100000000", "--tp", "8"],
     "argument --world-size: expected an integer in [1, 65536] (2**16: the tables of larger worlds take minutes"),
    (["ranks", "--world-size", "1" * 31], "expected an integer in [1, 65536] (2**16"),
    (["ranks", "--world-size", "0"], "argument --world-size: expected an integer in [1, 65536]"),
    (["ranks", "--world-size", "8", "--tp", "0"], "argument --tp: expected an integer in [1, 1048576] (2**20), got 0"),
    (["ranks", "--world-size", "8", "--dp-shard", "-2"], "argument --dp-shard: expected an integer in [-1, 1048576]"),
    (["ranks", "--world-size", "9" * 5000], "argument --world-size: invalid int value: '9999"),
])
def test_bad_input_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("meshplan: error: ") and message in err, err


def test_console_entry_point_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "meshplan", "ranks", "--world-size", "6", "--tp", "4"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "meshplan: error: tp(4) does not divide world_size(6); valid tp: 1, 2, 3, 6"


def test_keyboard_interrupt_one_line_exit_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr("meshplan.cli.ranks._ranks", interrupted)
    code, out, err = run(capsys, "ranks", "--world-size", "8")
    assert code == 130 and out == "" and err == "meshplan: error: interrupted\n"


def test_schema_command(capsys):
    code, out, _ = run(capsys, "schema")
    assert code == 0 and json.loads(out)["title"] == "meshplan plan"
