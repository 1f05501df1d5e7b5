"""sfstore.config_check and ``sfstore config check``: every problem of a config file and of the SFSTORE_*
variables, each named (file and line or key, variable), with what was expected; exit 1 on any error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfstore import config_check, defaults
from sfstore.environment import NON_SETTING_VARIABLES, check_environment

REPO = Path(__file__).resolve().parents[1]

# The cluster configuration as README and docs/cluster.md showed it: an inline table continued over two lines.
MULTILINE_TARGET = """\
[classes.hot]
path = "block"
target = { kind = "nvmeof", transport = "rdma", traddr = "10.0.0.5", trsvcid = "4420",
           subsysnqn = "nqn.2024-01.io.example:hot" }
"""


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SFSTORE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("SFSTORE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    defaults.reset()


def _env(**extra: str) -> dict[str, str]:
    """The environment of a CLI child: this test's variables, and this checkout first on the path."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sfstore.cli", *args], capture_output=True, text=True,
                          env=_env(**env), timeout=120, check=False)


def _messages(problems: list[config_check.ConfigProblem]) -> str:
    return "\n".join(str(p) for p in problems)


# -- the library -----------------------------------------------------------------------------------------------


def test_a_good_configuration_has_no_problems(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    text = (f'root = "{tmp_path / "mnt"}"\n[settings]\nqueue_depth = 64\nkvcache_shared_bytes = "2t"\n'
            '[classes.checkpoint]\nsubdir = "ckpt"\n'
            '[classes.hot]\npath = "block"\ntarget = { kind = "image", path = "/scratch/hot.img", size = "64G" }\n')
    assert config_check.check_toml(text, check_paths=True) == []
    f = tmp_path / "sfstore.toml"
    f.write_text(text)
    assert config_check.check_file(f) == []


def test_the_multiline_inline_table_is_explained_with_its_line() -> None:
    (p,) = config_check.check_toml(MULTILINE_TARGET, "README")
    assert p.severity == "error" and p.line == 3
    assert "not valid TOML" in p.message and "opened on line 3" in p.message
    assert "TOML 1.0" in p.message and "[classes.hot.target]" in p.message
    assert "README, line 3" in str(p)
    # The same table on one line, and as a table of its own, are fine.
    assert config_check.check_toml(MULTILINE_TARGET.replace(",\n          ", ",")) == []
    assert config_check.check_toml('[classes.hot.target]\nkind = "nvmeof"\ntransport = "rdma"\n'
                                   'traddr = "10.0.0.5"\ntrsvcid = "4420"\nsubsysnqn = "nqn.x:hot"\n') == []


def test_other_toml_errors_have_a_line_and_no_inline_table_hint() -> None:
    (p,) = config_check.check_toml('root = "/x"\nqueue_depth = \n')
    assert p.line == 2 and "not valid TOML" in p.message and "inline table" not in p.message


def test_every_problem_is_listed_not_only_the_first() -> None:
    text = """\
rooot = "/x"
queue_depth = 4
[settings]
queue_dept = 8
buffer_size = "lots"
kvcache_shared_bytes = "2048t"
engine = "iouring"
[classes.chekpoint]
path = "file"
[classes.dataset]
rot = "/y"
path = "block"
[classes.checkpoint]
subdir = "../out"
[classes.hot]
target = { kind = "imag" }
"""
    problems = config_check.check_toml(text, "cfg")
    text_out = _messages(problems)
    assert all(p.severity == "error" and p.source == "cfg" for p in problems), text_out
    expected = [
        ("rooot", "did you mean root?"),
        ("queue_depth", "[settings] queue_depth = ..."),
        ("settings.queue_dept", "did you mean queue_depth?"),
        ("settings.buffer_size", "512MB"),  # the accepted size forms
        ("settings.kvcache_shared_bytes", "expected 0 to 1024 TiB, not 2048 TiB"),
        ("settings.engine", "did you mean uring?"),
        ("classes.chekpoint", "did you mean checkpoint?"),
        ("classes.dataset.rot", "did you mean root?"),
        ("classes.dataset.path", "expected one of file"),
        ("classes.checkpoint.subdir", "beneath root"),
        ("classes.hot.target", "did you mean image?"),
    ]
    for key, needle in expected:
        assert any(p.key == key and needle in p.message for p in problems), (key, needle, text_out)
    assert len(problems) == len(expected), text_out


@pytest.mark.parametrize(
    ("text", "key", "needle"),
    [
        ("root = 5\n", "root", "must be a directory path"),
        ('root = "a\\u0000b"\n', "root", "NUL byte"),
        ("settings = 3\n", "settings", "must be a table"),
        ("classes = 3\n", "classes", "must be a table"),
        ("[classes]\ndataset = 3\n", "classes.dataset", "must be a table"),
        ('[classes.dataset]\ntarget = { kind = "image", path = "/x" }\n', "classes.dataset.target",
         "for path = 'block' only"),
        ('[classes.hot]\ntarget = { kind = "image", path = "/x", size = "lots" }\n', "classes.hot.target.size",
         "512MB"),
        ('[classes.hot]\ntarget = { kind = "image", path = "/x", mode = "rw" }\n', "classes.hot.target.mode",
         "unknown key"),
        ('[classes.hot]\ntarget = { kind = "device" }\n', "classes.hot.target", "needs 'device'"),
        ('[classes.hot]\ntarget = { kind = "nvmeof", traddr = "10.0.0.5" }\n', "classes.hot.target", "transport"),
        ("[settings]\nqueue_depth = true\n", "settings.queue_depth", "expected an integer"),
        ("[settings]\nbuffer_size = -4096\n", "settings.buffer_size", "expected 4 KiB to 16 GiB"),
        ("[settings]\nbuffer_size = 1.5\n", "settings.buffer_size", "not float"),
    ],
)
def test_each_bad_entry_is_named(text: str, key: str, needle: str) -> None:
    problems = config_check.check_toml(text)
    assert any(p.key == key and needle in p.message for p in problems), _messages(problems)


def test_roots_must_exist_when_paths_are_checked(tmp_path: Path) -> None:
    text = f'root = "{tmp_path / "nope"}"\n[classes.checkpoint]\nroot = "{tmp_path / "ckpt-nope"}"\n'
    assert config_check.check_toml(text) == []  # a docs example: its paths are someone else's
    problems = config_check.check_toml(text, "cfg", check_paths=True)
    assert {p.key for p in problems} == {"root", "classes.checkpoint.root"}
    assert all("does not exist" in p.message for p in problems)
    assert any("[classes.checkpoint] root in cfg" in p.message for p in problems)
    (tmp_path / "a-file").write_text("x")
    (p,) = config_check.check_toml(f'root = "{tmp_path / "a-file"}"\n', check_paths=True)
    assert "is not a directory" in p.message


def test_missing_file_and_directory(tmp_path: Path) -> None:
    (p,) = config_check.check_file(tmp_path / "nope.toml")
    assert p.severity == "error" and "does not exist" in p.message and str(tmp_path / "nope.toml") in p.source
    (p,) = config_check.check_file(tmp_path)
    assert "is a directory" in p.message


def test_environment_bad_values_are_errors_and_unknown_names_warnings() -> None:
    env = {"SFSTORE_QUEUE_DEPTH": "abc", "SFSTORE_ENGINE": "iouring", "SFSTORE_QUEUEDEPTH": "4",
           "SFSTORE_KVCACHE_SHARED_BYTES": "2t", "SFSTORE_BUFFER_SIZE": "", "SFSTORE_FROBNICATE": "1",
           "SFSTORE_TEST_NFS_MOUNT": "/mnt", "SFSTORE_TESTBED_DIR": "/x", "PATH": "/bin"}
    env.update({name: "x" for name in NON_SETTING_VARIABLES})
    problems = {p.key: p for p in check_environment(env)}
    assert set(problems) == {"SFSTORE_QUEUE_DEPTH", "SFSTORE_ENGINE", "SFSTORE_QUEUEDEPTH", "SFSTORE_FROBNICATE"}
    assert problems["SFSTORE_QUEUE_DEPTH"].severity == "error"
    depth = problems["SFSTORE_QUEUE_DEPTH"].message
    assert "'abc'" in depth and "1 to 16384" in depth
    assert "did you mean uring?" in problems["SFSTORE_ENGINE"].message
    assert problems["SFSTORE_QUEUEDEPTH"].severity == "warning"
    assert "did you mean SFSTORE_QUEUE_DEPTH?" in problems["SFSTORE_QUEUEDEPTH"].message
    assert problems["SFSTORE_FROBNICATE"].severity == "warning" and "did you mean" not in problems[
        "SFSTORE_FROBNICATE"].message


def test_every_sfstore_variable_the_project_reads_is_known() -> None:
    """Grep the tree: each SFSTORE_* name used in code, scripts and tests is a setting, a listed non-setting
    name, or under a listed prefix (so no variable the project itself sets is ever warned about)."""
    import re

    names: set[str] = set()
    misspelling_tests = {"test_config_check.py", "test_router.py", "test_probe.py", "environment.py"}  # on purpose
    for top in ("sfstore", "tools", "tests", "native", ".ci"):
        for path in (REPO / top).rglob("*"):
            if (path.is_file() and path.suffix in ("", ".py", ".sh", ".txt", ".toml")
                    and "__pycache__" not in path.parts and path.name not in misspelling_tests):
                names |= set(re.findall(r"\bSFSTORE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    # Compile-time names of the native build (C preprocessor macros, CMake options), never read from the environment.
    names -= {"SFSTORE_HAVE_LIBURING", "SFSTORE_HAVE_XXHASH", "SFSTORE_HAVE_XXH3_AVX2", "SFSTORE_WITH_URING",
              "SFSTORE_WITH_XXHASH"}
    warned = {p.key for p in check_environment({n: "1" for n in names}) if p.severity == "warning"}
    assert not warned, f"SFSTORE_* names the project uses but environment.py does not know: {sorted(warned)}"


def test_check_finds_the_file_that_applies_and_the_env_root(tmp_path: Path) -> None:
    cfg = tmp_path / "sfstore.toml"
    cfg.write_text("[settings]\nqueue_depth = 0\n")
    path, problems = config_check.check(environ={"SFSTORE_ROOT": str(tmp_path / "missing")})
    assert path == str(cfg)
    assert {p.key for p in problems} == {"settings.queue_depth", "SFSTORE_ROOT"}
    (root_problem,) = [p for p in problems if p.key == "SFSTORE_ROOT"]
    assert "does not exist" in root_problem.message and "SFSTORE_ROOT" in root_problem.message


# -- the command -------------------------------------------------------------------------------------------------


def test_cli_ok_exits_0_and_a_misspelt_variable_exits_1(tmp_path: Path) -> None:
    result = cli("config", "check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "configuration OK: no config file (defaults and SFSTORE_* variables)"
    # The library only warns about a name it does not read; the checker fails: the setting meant is not in force.
    result = cli("config", "check", SFSTORE_QUEUEDEPTH="8")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error: environment variable SFSTORE_QUEUEDEPTH" in result.stdout
    assert "did you mean SFSTORE_QUEUE_DEPTH?" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("configuration has 1 error(s)")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[settings]\nqueue_depth = 'deep'\n", "[settings] queue_depth: invalid value 'deep'"),
        ("[settings]\nqueue_dept = 4\n", "did you mean queue_depth?"),
        (MULTILINE_TARGET, "line 3: not valid TOML"),
        ('root = "@TMP@/no-such-mount"\n', "does not exist"),
        ("[classes.hot]\ntarget = { kind = 'disk' }\n", "'kind' must be one of image, device, nvmeof"),
    ],
)
def test_cli_bad_file_exits_1_naming_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text.replace("@TMP@", str(tmp_path)))
    result = cli("config", "check", str(cfg))
    assert result.returncode == 1, result.stdout + result.stderr
    assert needle in result.stdout and f"config file {cfg}" in result.stdout, result.stdout
    assert result.stdout.splitlines()[-1].startswith("configuration has 1 error(s)")


def test_cli_missing_file_directory_and_env(tmp_path: Path) -> None:
    result = cli("config", "check", str(tmp_path / "nope.toml"))
    assert result.returncode == 1 and "does not exist" in result.stdout
    result = cli("config", "check", str(tmp_path))
    assert result.returncode == 1 and "is a directory" in result.stdout
    result = cli("config", "check", SFSTORE_QUEUE_DEPTH="abc", SFSTORE_ENGINE="iouring")
    assert result.returncode == 1
    assert "error: environment variable SFSTORE_QUEUE_DEPTH: invalid value 'abc'" in result.stdout
    assert "error: environment variable SFSTORE_ENGINE: invalid value 'iouring'" in result.stdout
    cfg = tmp_path / "env.toml"
    cfg.write_text("[settings]\nio_threads = 0\n")
    result = cli("config", "check", SFSTORE_CONFIG=str(cfg))  # the file SFSTORE_CONFIG names is the one checked
    assert result.returncode == 1 and f"config file {cfg}: [settings] io_threads" in result.stdout


def test_cli_config_without_a_subcommand_is_usage() -> None:
    result = cli("config")
    assert result.returncode == 2 and "check" in result.stderr


def test_a_bad_cache_namespace_is_caught_before_the_kv_cache_opens() -> None:
    (p,) = check_environment({"SFSTORE_KVCACHE_NAMESPACE": "../other"})
    assert p.severity == "error" and "1 to 64 letters" in p.message
    assert check_environment({"SFSTORE_KVCACHE_NAMESPACE": "model-a.v2"}) == []
    (p,) = config_check.check_toml('[settings]\nkvcache_namespace = "a/b"\n')
    assert p.key == "settings.kvcache_namespace"


def test_other_commands_warn_about_an_unknown_variable_in_words() -> None:
    result = cli("ls", SFSTORE_QUEUEDEPTH="8")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ("sfstore ls: warning: environment variable SFSTORE_QUEUEDEPTH: not a variable "
                                     "sfstore reads (did you mean SFSTORE_QUEUE_DEPTH?); `python -m sfstore.defaults` "
                                     "lists the settings")


def test_a_read_only_data_dir_is_an_error(tmp_path: Path) -> None:
    from tests.conftest import tmpfs_mount

    with tmpfs_mount(tmp_path / "ro") as read_only:
        read_only()
        _, problems = config_check.check(environ={"SFSTORE_DATA_DIR": str(tmp_path / "ro")})
        result = cli("config", "check", SFSTORE_DATA_DIR=str(tmp_path / "ro"))
    (p,) = problems
    assert p.key == "data_dir" and p.source == "environment variable SFSTORE_DATA_DIR"
    assert "read-only file system" in p.message and "SFSTORE_DATA_DIR" in p.message
    assert result.returncode == 1 and "read-only file system" in result.stdout
