"""Every `python -m tools.weights` command, given an input file that is missing or broken (a safetensors
shard whose header length is absurd, cut short, or whose header is not JSON; a config.json, index or
manifest that is not JSON; a truncated rank file or .distcp file; a parquet file that is not one), exits 2
with ONE line that names the file and what is wrong with it, and no traceback.

The inputs are make-tiny checkpoints and their conversions, broken by the test."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tools.data.cli import main as data_main
from tools.weights.cli import main
from tools.weights.io import INDEX
from tools.weights.tiny import make_tiny

SUMS = ["--ops", "+", "--max-operand", "9", "--max-terms", "2", "--unique", "--instruction", "Answer in \\boxed{}."]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Good inputs for every command: bf16 and FP8 checkpoints, both conversions, a task's parquet files."""
    base = tmp_path_factory.mktemp("inputs")
    make_tiny(base / "hf", shards=2)
    make_tiny(base / "fp8", fp8=True, shards=2)
    assert main(["hf-to-mcore", "--src", str(base / "hf"), "--dst", str(base / "legacy"), "--format", "legacy",
                 "--jobs", "1"]) == 0
    assert main(["hf-to-mcore", "--src", str(base / "hf"), "--dst", str(base / "dist"), "--jobs", "1"]) == 0
    assert data_main(["synthetic-arith", "--dst", str(base / "data"), "--n", "40", "--test-ratio", "0.2", *SUMS]) == 0
    return base


@pytest.fixture
def inputs(made, tmp_path) -> Path:
    """A copy of the good inputs that a test may break."""
    shutil.copytree(made, tmp_path / "in")
    return tmp_path / "in"


def run(capsys, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, path: Path, *words: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert str(path) in err, f"the message does not name {path}: {err}"
    for word in words:
        assert word in err, f"{word!r} not in {err}"


# ---------------------------------------------------------------- broken HF checkpoints

def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.safetensors"))[-1]


def _header_length(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def absurd_header_length(ckpt: Path) -> Path:
    path = _shard(ckpt)
    path.write_bytes((1 << 62).to_bytes(8, "little") + path.read_bytes()[8:])
    return path


def header_length_past_the_end(ckpt: Path) -> Path:
    path = _shard(ckpt)
    data = path.read_bytes()
    path.write_bytes(len(data).to_bytes(8, "little") + data[8:])
    return path


def truncated(ckpt: Path) -> Path:
    path = _shard(ckpt)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])
    return path


def header_not_json(ckpt: Path) -> Path:
    path = _shard(ckpt)
    data, n = path.read_bytes(), _header_length(path)
    path.write_bytes(data[:8] + b"{" + b"\xff" * (n - 1) + data[8 + n:])
    return path


def empty_shard(ckpt: Path) -> Path:
    path = _shard(ckpt)
    path.write_bytes(b"")
    return path


def missing_shard(ckpt: Path) -> Path:
    path = _shard(ckpt)
    path.unlink()
    return path


def config_not_json(ckpt: Path) -> Path:
    (ckpt / "config.json").write_text('{"vocab_size": 320,')
    return ckpt / "config.json"


def config_a_list(ckpt: Path) -> Path:
    (ckpt / "config.json").write_text("[320]")
    return ckpt / "config.json"


def config_missing(ckpt: Path) -> Path:
    (ckpt / "config.json").unlink()
    return ckpt / "config.json"


def index_not_json(ckpt: Path) -> Path:
    (ckpt / INDEX).write_text("weight_map: everything")
    return ckpt / INDEX


HF_BREAKS: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    "absurd-header-length": (absurd_header_length, ("header length", "is absurd")),
    "header-length-past-the-end": (header_length_past_the_end, ("header length", "truncated?")),
    "truncated": (truncated, ("truncated?",)),
    "header-not-json": (header_not_json, ("header is not JSON",)),
    "empty-shard": (empty_shard, ("shorter than the 8-byte header length",)),
    "missing-shard": (missing_shard, ()),
    "config-not-json": (config_not_json, ("not JSON", "line 1")),
    "config-a-list": (config_a_list, ("expected an object",)),
    "config-missing": (config_missing, ("not found",)),
    "index-not-json": (index_not_json, ("not JSON",)),
}
# (argv with {src} {dst} {legacy} {dist} {data}, which checkpoint {src} is)
HF_COMMANDS: dict[str, tuple[str, str]] = {
    "fp8-to-bf16": ("fp8-to-bf16 --src {src} --dst {dst} --workers 1", "fp8"),
    "fp8-to-bf16 --dry-run": ("fp8-to-bf16 --src {src} --dst {dst} --dry-run", "fp8"),
    "hf-to-mcore": ("hf-to-mcore --src {src} --dst {dst} --jobs 1", "hf"),
    "hf-to-mcore --dry-run": ("hf-to-mcore --src {src} --dst {dst} --dry-run", "hf"),
    "hf-to-mcore legacy": ("hf-to-mcore --src {src} --dst {dst} --format legacy --jobs 1", "hf"),
    "hf-to-mcore legacy --dry-run": ("hf-to-mcore --src {src} --dst {dst} --format legacy --dry-run", "hf"),
    "verify legacy": ("verify --src {src} --converted {legacy}", "hf"),
    "verify torch_dist": ("verify --src {src} --converted {dist}", "hf"),
    "warm-start": ("warm-start --src {src} --train {data}/train.parquet --dst {dst} --steps 1", "hf"),
    "warm-start --dry-run": ("warm-start --src {src} --train {data}/train.parquet --dst {dst} --dry-run", "hf"),
}


def argv(template: str, inputs: Path, src: str) -> list[str]:
    return template.format(src=inputs / src, dst=inputs / "out", legacy=inputs / "legacy", dist=inputs / "dist",
                           data=inputs / "data", config=inputs / src).split()


@pytest.mark.parametrize("command", HF_COMMANDS)
@pytest.mark.parametrize("broken", HF_BREAKS)
def test_a_broken_hf_checkpoint(inputs, capsys, command, broken):
    template, src = HF_COMMANDS[command]
    breaker, words = HF_BREAKS[broken]
    path = breaker(inputs / src)
    code, err = run(capsys, argv(template, inputs, src))
    assert_one_line(code, err, path if broken != "missing-shard" else path.parent, *words)
    if broken == "missing-shard":
        assert path.name in err


@pytest.mark.parametrize("broken", ["config-not-json", "config-a-list", "config-missing"])
def test_mcore_to_hf_with_a_broken_config(inputs, capsys, broken):
    breaker, words = HF_BREAKS[broken]
    path = breaker(inputs / "hf")
    code, err = run(capsys, argv("mcore-to-hf --src {legacy} --config {config} --dst {dst}", inputs, "hf"))
    assert_one_line(code, err, path, *words)


# ---------------------------------------------------------------- broken conversions

def _rank_file(inputs: Path) -> Path:
    return sorted((inputs / "legacy").rglob("model_optim_rng.pt"))[0]


def manifest_not_json(inputs: Path, fmt: str) -> Path:
    path = inputs / fmt / "manifest.json"
    path.write_text('{"header": ')
    return path


def manifest_without_header(inputs: Path, fmt: str) -> Path:
    path = inputs / fmt / "manifest.json"
    path.write_text('{"files": {}}')
    return path


def rank_file_truncated(inputs: Path, fmt: str) -> Path:
    path = _rank_file(inputs)
    path.write_bytes(path.read_bytes()[:1000])
    return path


def rank_file_missing(inputs: Path, fmt: str) -> Path:
    path = _rank_file(inputs)
    path.unlink()
    return path


def metadata_garbage(inputs: Path, fmt: str) -> Path:
    path = inputs / "dist" / ".metadata"
    path.write_bytes(b"not a pickle at all")
    return path


def distcp_truncated(inputs: Path, fmt: str) -> Path:
    path = max((inputs / "dist").glob("*.distcp"), key=lambda p: p.stat().st_size)
    path.write_bytes(path.read_bytes()[:100])
    return path


CONVERTED_BREAKS: dict[str, tuple[Callable[[Path, str], Path], tuple[str, ...], tuple[str, ...]]] = {
    # name: (breaker, formats, words)
    "manifest-not-json": (manifest_not_json, ("legacy", "dist"), ("not JSON",)),
    "manifest-without-header": (manifest_without_header, ("legacy", "dist"), ("not written by hf-to-mcore",)),
    "rank-file-truncated": (rank_file_truncated, ("legacy",), ("not a readable rank file",)),
    "rank-file-missing": (rank_file_missing, ("legacy",), ("missing",)),
    "metadata-garbage": (metadata_garbage, ("dist",), ("not a readable torch_dist .metadata",)),
    "distcp-truncated": (distcp_truncated, ("dist",), ("truncated?",)),
}
CONVERTED_COMMANDS = {
    "verify": "verify --src {src} --converted {converted}",
    "mcore-to-hf": "mcore-to-hf --src {converted} --config {src} --dst {dst}",
}
CASES = [(command, broken, fmt) for command in CONVERTED_COMMANDS for broken, (_, fmts, _) in CONVERTED_BREAKS.items()
         for fmt in fmts if command == "verify" or fmt == "legacy"]


@pytest.mark.parametrize("command, broken, fmt", CASES)
def test_a_broken_conversion(inputs, capsys, command, broken, fmt):
    breaker, _, words = CONVERTED_BREAKS[broken]
    path = breaker(inputs, fmt)
    template = CONVERTED_COMMANDS[command].replace("{converted}", str(inputs / fmt))
    code, err = run(capsys, argv(template, inputs, "hf"))
    assert_one_line(code, err, path, *words)


# ---------------------------------------------------------------- warm-start's tables, make-tiny's destination

@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("which, breaker, words", [
    ("train", lambda p: p.unlink(), ("not found",)),
    ("train", lambda p: p.write_text("prompt,answer\n1+1,2\n"), ("not a tools.data parquet file",)),
    ("test", lambda p: p.write_bytes(b"PAR1" + b"\0" * 64), ("not a tools.data parquet file",)),
])
def test_warm_start_with_a_broken_table(inputs, capsys, dry_run, which, breaker, words):
    path = inputs / "data" / f"{which}.parquet"
    breaker(path)
    command = "warm-start --src {src} --train {data}/train.parquet --held-out {data}/test.parquet --dst {dst} --steps 1"
    code, err = run(capsys, argv(command, inputs, "hf") + (["--dry-run"] if dry_run else []))
    assert_one_line(code, err, path, *words)
    assert not (inputs / "out").exists()


def test_warm_start_with_a_tokenizer_file_that_is_not_json(inputs, capsys):
    path = inputs / "hf" / "tokenizer_config.json"
    path.write_text("{")
    code, err = run(capsys, argv("warm-start --src {src} --train {data}/train.parquet --dst {dst} --dry-run",
                                 inputs, "hf"))
    assert_one_line(code, err, path, "not JSON")


def test_make_tiny_onto_a_file(tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.write_text("a file, not a folder")
    code, err = run(capsys, ["make-tiny", "--dst", str(dst)])
    assert_one_line(code, err, dst)


def test_the_issue_s_case_as_a_user_runs_it(inputs):
    """`python -m tools.weights hf-to-mcore` on a shard whose header length is absurd ended in
    `SafetensorError: ... header too large` and a traceback."""
    import subprocess
    import sys

    path = absurd_header_length(inputs / "hf")
    proc = subprocess.run([sys.executable, "-m", "tools.weights", "hf-to-mcore", "--src", str(inputs / "hf"),
                           "--dst", str(inputs / "out")], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {path}: not a readable safetensors file: header length 4611686018427387904"
                                  " bytes is absurd")
