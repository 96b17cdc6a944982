"""`mgtrace report` writes one self-contained HTML file that a real browser renders."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import mgtrace
from tests.conftest import assert_one_sentence_error, run_cli

pytest.importorskip("matplotlib", reason="the report extra is not installed")

pytestmark = pytest.mark.slow

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report")
    mgtrace.simulate(root / "run", steps=800, seed=0, bugs=["reorder-threshold-mismatch"])
    out = root / "report.html"
    proc = run_cli("report", str(root / "run"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def test_report_is_self_contained(report: Path) -> None:
    text = report.read_text()
    assert "corruption starts at step" in text and "--reorder-threshold=1+k" in text
    assert len(re.findall(r'src="data:image/png;base64,', text)) >= 4
    assert not re.search(r'(src|href)="(https?:|file:|/)', text)  # nothing fetched from outside
    for heading in ("Run", "Timeline", "Accepted counts", "Findings (replay as recorded)"):
        assert f"<h2>{heading}</h2>" in text
    # the first bad request's history, with the report's own findings (nothing was saved)
    history = text.split("<h2>History of the first requests</h2>")[1]
    assert "<code>req-000002</code>" in history and "wrong_tokens:" in history
    assert "<td>15</td>" in history  # the injected first step is one of its lines


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("CI"):
        pytest.fail("CI must install Debian's chromium for the report test (see .ci/run)")
    return found


def test_report_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium is not installed here")
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, *profile, "--dump-dom", report.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert 'id="verdict"' in dom and "corruption starts at step" in dom
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            *profile,
            "--window-size=1200,2400",
            f"--screenshot={shot}",
            report.as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 50_000  # plots, not a blank page


def test_report_refuses_to_overwrite(report: Path) -> None:
    proc = run_cli("report", str(report.parent / "run"), "-o", str(report), "--no-bisect")
    assert "already exists" in assert_one_sentence_error(proc, 2)


def test_report_prints_a_path_with_brackets_as_it_is(report: Path, tmp_path: Path) -> None:
    """The "wrote" line went through rich markup: "r[bold]x.html" was printed as "rx.html"."""
    proc = run_cli(
        "report", str(report.parent / "run"), "-o", "r[bold]x.html", "--no-bisect", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote r[bold]x.html" in proc.stderr and (tmp_path / "r[bold]x.html").is_file()


def test_report_of_a_trace_with_a_left_out_part(report: Path, tmp_path: Path) -> None:
    """Gaps make the verdict inconclusive, not the report impossible: it still shows what a
    replay across them finds, under a warning. (It used to stop at the replay's refusal.)"""
    import json

    trace = tmp_path / "run"
    shutil.copytree(report.parent / "run", trace)
    parts = json.loads((trace / "manifest.json").read_text())["parts"]
    rel = next(p["path"] for p in parts if p["table"] == "block_tables")
    (trace / rel).write_bytes(b"PAR1 garbage")
    out = tmp_path / "gapped.html"
    proc = run_cli("report", str(trace), "--skip-bad-parts", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    # the only block-table part: no step can be replayed, as `replay` says
    assert "class='verdict inconclusive'" in text and "No step could be replayed" in text
    # the run section names the part left out (it once said only "complete")
    assert f"left-out part</td><td>{rel}: " in text, text[:3000]
    assert "left-out part" not in report.read_text()
    # dropped steps before the first finding: the replay across them shows its findings
    from tests.replay_helpers import with_steps_removed

    gapped = with_steps_removed(report.parent / "run", tmp_path / "gapped", {3, 4})
    proc = run_cli("report", str(gapped), "-o", str(tmp_path / "dropped.html"))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "dropped.html").read_text()
    assert "class='verdict inconclusive'" in text and "class='warn'" in text
    assert "corruption starts" not in text and "<h2>Findings (replay as recorded)</h2>" in text
    assert "class='warn'" not in report.read_text()  # the control: a whole trace, no warning


def test_report_of_an_imported_probe_log(tmp_path: Path) -> None:
    """A probe import holds no kernel launches: no replay, and the report says so, but the
    run, the timeline and the client labels' cross-tab are there (it used to stop at the
    replay's refusal, and said the pool size was missing)."""
    from mgtrace.recorder.probe_import import import_probe
    from tests.test_recorder_unit import _probe_logs

    probe, burst, _ = _probe_logs(tmp_path)
    import_probe(probe, burst, tmp_path / "imp")
    out = tmp_path / "imp.html"
    proc = run_cli("report", str(tmp_path / "imp"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "no replay: the trace holds no align-kernel launches" in text
    assert "<h2>Field re-analysis</h2>" in text and "FIRST decode step in Mamba prefill" in text
    assert "<h2>Findings (replay as recorded)</h2>" not in text
    err = assert_one_sentence_error(run_cli("replay", str(tmp_path / "imp")), 2)
    assert "imported from a probe log" in err


def test_report_crosses_the_first_decode_with_its_findings(report: Path) -> None:
    text = report.read_text()
    section = text.split("<h2>Field re-analysis</h2>")[1]
    assert "first_decode_in_prefill_split" in section and "flagged_by_replay" in section
    assert "Client labels" not in section  # a simulated run has no client labels


def test_a_pipeline_parallel_report_shows_the_histories_of_one_rank(tmp_path: Path) -> None:
    """Both ranks record the same batch: the histories keep the first finding's rank, and
    their heading names it, rather than show every step twice."""
    mgtrace.simulate(
        tmp_path / "pp", steps=60, seed=0, runner="v2", pp=2, bugs=["batch-row-block-table"]
    )
    out = tmp_path / "pp.html"
    proc = run_cli("report", str(tmp_path / "pp"), "-o", str(out), "--no-bisect")
    assert proc.returncode == 0, proc.stderr
    heading, history = (
        out.read_text().split("<h2>History of the first requests (rank ")[1].split("</h2>", 1)
    )
    tables = history.split("<h2>")[0].split("<h3>")[1:]  # a table per request
    assert tables
    for table in tables:
        rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td>", table)
        steps = [step for _, step in rows]
        assert steps and len(steps) == len(set(steps))  # one line per step
        assert {rank for rank, _ in rows} == {heading.rstrip(")")}


def _section(text: str, heading: str) -> str:
    return text.split(f"<h2>{heading}</h2>")[1].split("<h2>")[0]


def test_a_run_without_drafts_says_why_instead_of_empty_plots_and_tables(tmp_path: Path) -> None:
    """With k = 0 no row drafts: the accepted counts were an empty plot, and the findings
    list and the field re-analysis tables of headers alone."""
    mgtrace.simulate(tmp_path / "k0", steps=300, seed=0, k=0)
    out = tmp_path / "k0.html"
    proc = run_cli("report", str(tmp_path / "k0"), "-o", str(out), "--no-bisect")
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    accepted = _section(text, "Accepted counts")
    assert "<img" not in accepted
    assert "no speculative decoding in this run (k = 0)" in accepted
    assert "no speculative decoding in this run (k = 0)" in _section(text, "Field re-analysis")
    assert "No findings:" in _section(text, "Findings (replay as recorded)")
    assert not re.search(r"<table><tr>(<th>[^<]*</th>)*</tr></table>", text)


def test_the_run_table_leaves_out_what_the_run_lacks_as_info_does(
    report: Path, tmp_path: Path
) -> None:
    """A V2 runner has no reorder threshold of its own: `mgtrace info` leaves the row out,
    the report showed it blank."""
    mgtrace.simulate(tmp_path / "v2", steps=60, seed=0, runner="v2")
    out = tmp_path / "v2.html"
    proc = run_cli("report", str(tmp_path / "v2"), "-o", str(out), "--no-bisect")
    assert proc.returncode == 0, proc.stderr
    assert "runner reorder threshold" not in run_cli("info", str(tmp_path / "v2")).stdout
    run = _section(out.read_text(), "Run")
    assert "runner reorder threshold" not in run and "<td></td>" not in run
    # the control: a V1 runner's threshold is shown
    assert "<td>runner reorder threshold</td><td>1</td>" in _section(report.read_text(), "Run")


def _footer_commands(text: str) -> tuple[str, list[list[str]]]:
    import html
    import shlex

    footer = re.search(r"<p>\d+ more findings not shown.*?</p>", text)
    assert footer is not None
    commands = re.findall(r"<code>(.*?)</code>", footer.group(0))
    return footer.group(0), [shlex.split(html.unescape(c)) for c in commands]


def test_the_findings_footer_gives_the_commands_that_list_them(
    report: Path, tmp_path: Path
) -> None:
    """It said only "query them with `mgtrace sql`": no trace, no replay id. The report saves
    no findings, so it names the replay that saves them, then the query that lists them."""
    shutil.copytree(report.parent / "run", tmp_path / "-a run")  # a path that needs quoting
    proc = run_cli("report", "./-a run", "-o", "r.html", "--no-bisect", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    footer, commands = _footer_commands((tmp_path / "r.html").read_text())
    total = int(re.search(r"list all (\d+)", footer).group(1))
    assert [c[:3] for c in commands] == [
        ["mgtrace", "replay", "./-a run"],
        ["mgtrace", "sql", "./-a run"],
    ]
    for command in commands:
        proc = run_cli(*command[1:], cwd=tmp_path)
        assert proc.returncode in (0, 1), proc.stderr  # replay: 1, corruption found
    assert len(proc.stdout.splitlines()) == total + 1  # a CSV header and every finding
    # saved now: the query alone
    proc = run_cli("report", "./-a run", "-o", "saved.html", "--no-bisect", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    _, commands = _footer_commands((tmp_path / "saved.html").read_text())
    assert [c[:3] for c in commands] == [["mgtrace", "sql", "./-a run"]]


def test_block_ownership_leaves_out_the_null_block(report: Path) -> None:
    """Block 0 pads every request's block list: hundreds of points along y = 0."""
    from mgtrace.api import Trace
    from mgtrace.query import plots

    fig = plots.block_ownership(Trace(report.parent / "run"), ["req-000002", "req-000003"])
    blocks = [y for c in fig.axes[0].collections for _, y in c.get_offsets()]
    assert blocks and min(blocks) > 0


def test_a_report_that_replayed_no_step_claims_no_clean_run(report: Path, tmp_path: Path) -> None:
    """With the batch rows' only part left out the verdict was "no step could be replayed",
    yet the findings said "No findings: the replay found no request reading state that is
    not its own", and the accepted counts and re-analysis blamed the run ("no spec-decode
    row recorded an accepted count"). Now each says what the trace lacks. Control: the
    whole trace's report plots its accepted counts."""
    import json

    trace = tmp_path / "run"
    shutil.copytree(report.parent / "run", trace)
    parts = json.loads((trace / "manifest.json").read_text())["parts"]
    (rel,) = [p["path"] for p in parts if p["table"] == "batch_rows"]
    (trace / rel).write_bytes(b"PAR1 garbage")
    out = tmp_path / "lacking.html"
    proc = run_cli("report", str(trace), "--skip-bad-parts", "--no-bisect", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "No findings" not in text and "No step could be replayed" in text
    assert "no spec-decode row recorded" not in text and "no request ran a spec-decode" not in text
    assert text.count("a part that --skip-bad-parts left out") == 2
    assert "No accepted counts to plot" not in report.read_text()  # the control


def test_a_trace_replaced_while_the_report_is_made_is_one_sentence_for_the_shell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Python API's advice (call reload()) means nothing to a shell user: the command
    says to run it again instead, exit 3, and writes no report."""
    import mgtrace.report as report_module
    from mgtrace.cli import main

    path = tmp_path / "t.trace"
    mgtrace.simulate(path, steps=120, bugs=["reorder-threshold-mismatch"])
    real = report_module.build_report

    def replaced_first(trace, **kwargs):  # as `simulate --force` in another shell
        mgtrace.simulate(path, steps=150, seed=3, force=True)
        return real(trace, **kwargs)

    monkeypatch.setattr(report_module, "build_report", replaced_first)
    out = tmp_path / "r.html"
    assert main(["report", str(path), "-o", str(out), "--no-bisect"]) == 3
    err = capsys.readouterr().err
    assert "replaced or removed the trace at" in err and "during mgtrace report" in err, err
    assert "reload()" not in err and not out.exists()
    monkeypatch.undo()  # control: the trace as it stands now is reported
    assert main(["report", str(path), "-o", str(out), "--no-bisect"]) == 0 and out.exists()
