"""The README's Quick start commands and .ci/run must not drift apart."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_ci_runs_exactly_the_readme_test_command():
    commands = _quick_start_commands()
    assert len(commands) == 2, "Quick start must hold exactly two commands: the main job and the tests"
    test_cmd = commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^TEST_CMD='(.*)'$", ci, flags=re.M)
    assert match, ".ci/run must define TEST_CMD"
    assert match.group(1) == test_cmd


def test_main_job_runs_on_a_bundled_sample_dump():
    main_cmd = _quick_start_commands()[0]
    dumps = re.findall(r"sample_dumps/[\w.-]+\.zarr", main_cmd)
    assert dumps, "the main job must run on a bundled sample dump"
    for dump in dumps:
        assert (ROOT / dump / "zarr.json").is_file(), f"{dump} is not in the repository"
