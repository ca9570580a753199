"""bench/animate.py: the frames of a measured step agree with the run's own ledgers, for every stage on 2 ranks; each
check fails on a planted slip (a unit never freed, in the frame data and in a copy of stage3.py; the peak's
allocation lost; a collective the frames never issue; a collective's bytes miscounted). Six runs of a tiny GPT, one
of them drawn, and the published animation drawn again from its frames."""
import copy
import json
import os
import re
import subprocess
import sys

import pytest
from PIL import Image

from conftest import ROOT, last_lines
from test_readme import QUESTION_OF

sys.path.insert(0, str(ROOT / "bench"))
import animate  # noqa: E402
import results  # noqa: E402
from timeline import run  # noqa: E402

MODEL = ["--steps", "2", "--preset", "tiny"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """recorded(script, nproc=2, *options) -> (summary, ranks) of a 2-step run of `script` (a path) on nproc ranks;
    once each. An option "NVME" is a fresh directory."""
    done = {}

    def take(script, nproc=2, *options):
        if (script, nproc, options) not in done:
            out = tmp_path_factory.mktemp("animate")
            given = [str(tmp_path_factory.mktemp("nvme")) if o == "NVME" else o for o in options]
            run(script, nproc, MODEL + given, out)
            done[script, nproc, options] = animate.read(out)
        return done[script, nproc, options]
    return take


@pytest.mark.parametrize("script", ["stage0_ddp.py", "stage1.py", "stage2.py", "stage3.py", "offload.py"])
def test_frames_agree_with_the_ledgers(recorded, script):
    summary, ranks = recorded(ROOT / script)
    data = animate.frames(summary, ranks)
    assert animate.check(summary, ranks, data) == []
    events = " | ".join(f["event"] for f in data)
    # the story each stage tells: what it gathers, frees, reduces and copies
    assert ("a unit gathered" in events and "a unit freed" in events) == (script in ("stage3.py", "offload.py"))
    assert ("reduce-scatter" in events) == (script != "stage0_ddp.py")
    assert ("C++ AdamW" in events and "a copy to the host" in events) == (script == "offload.py")
    assert "its memory peaks" in events
    if script == "stage3.py":
        tags = {tag for f in data for tag in f["lesson"].split()}
        assert {"[ZeRO-3]", "[Prefetch]", "[ZeRO-2]"} <= tags


@pytest.mark.parametrize("script, nproc, options", [
    ("stage3.py", 1, ()),
    ("stage3.py", 4, ()),
    ("offload.py", 4, ("--delayed_update", "--offload_params")),
    # (the NVMe run course/README.md names: one run for both tests)
    ("offload.py", 2, ("--offload_optimizer", "nvme", "--nvme_path", "NVME", "--nvme_buffer_count", "1"))],
    ids=["stage3-1", "stage3-4", "dpu-params-4", "nvme-2"])
def test_one_and_four_ranks_and_offloads_options(recorded, script, nproc, options):
    summary, ranks = recorded(ROOT / script, nproc, *options)
    data = animate.frames(summary, ranks)
    assert len(data[0]["ranks"]) == nproc
    assert animate.check(summary, ranks, data) == []
    events = " | ".join(f["event"] for f in data)
    tags = {tag for f in data for tag in f["lesson"].split()}
    if "--delayed_update" in options:  # the C++ AdamW on the update thread: the timeline's spans, not the holdings
        assert "[DPU]" in tags and "on the update thread" in events
    if "nvme" in options:
        assert "[NVMe]" in tags and "the NVMe tier reads" in events and "the NVMe tier writes" in events
    if script == "stage3.py":
        assert {"[ZeRO-3]", "[Prefetch]", "[ZeRO-2]"} <= tags


def course_frames():
    """course/README.md's animated step: (label, the run's arguments, the captions it names) per question."""
    text = (ROOT / "course" / "README.md").read_text()
    section = text[text.index("## The animated step"):]
    section = section[:section.index("\n## ")]
    bullets = [" ".join(b.split()) for b in section.split("\n- ")[1:]]
    return [(b.split(" (", 1)[0], re.search(r"`([^`]+)`", b).group(1).split(), re.findall(r"“(.*?)”", b))
            for b in bullets]


@pytest.mark.parametrize("label, arguments, captions", course_frames(), ids=[c[0] for c in course_frames()])
def test_the_course_names_frames_the_animation_draws(recorded, label, arguments, captions):
    """Each frame course/README.md sends a student to, by its caption, is one the named run's animation draws; each
    names a question of README.md."""
    assert label in QUESTION_OF.values() and captions, (label, captions)
    script, *options = arguments
    summary, ranks = recorded(ROOT / script, 2, *["NVME" if o == "DIR" else o for o in options])
    drawn = [f"{f['event']} {f['lesson']}" for f in animate.drawn(animate.frames(summary, ranks))]
    missing = [c for c in captions if not any(c in caption for caption in drawn)]
    assert not missing, f"{label}: no frame of {' '.join(arguments)} says {missing}"


def gathered_then_kept(ranks, r):
    """Rank r's holdings as if the first unit it freed had stayed gathered: each later sample keeps its bytes."""
    ranks = copy.deepcopy(ranks)
    samples = ranks[r]["holdings"]
    before = None
    for i, h in enumerate(samples):
        params = animate.holding(h)[0].get("params", 0)
        if before is not None and params < before:
            for later in samples[i:]:
                later["beyond"]["kept unit.param"] = before - params
            return ranks
        before = params
    raise AssertionError("rank {r} freed no unit")


def test_each_check_fails_on_a_planted_slip(recorded):
    summary, ranks = recorded(ROOT / "stage3.py")
    # a unit never freed: the end frame draws more parameters than the ledger measured
    kept = gathered_then_kept(ranks, 0)
    wrong = animate.check(summary, kept, animate.frames(summary, kept))
    assert len(wrong) == 1 and wrong[0].startswith("rank 0: the end frame draws"), wrong
    # the allocation that made rank 1's peak, lost: no frame reaches the meter's peak
    lost = copy.deepcopy(ranks)
    memory = lost[1]["memory"]
    when, _ = animate.peak_moment(memory)
    largest = max((e for e in memory["events"] if e[0] <= when), key=lambda e: e[1])
    memory["events"].remove(largest)
    wrong = animate.check(summary, lost, animate.frames(summary, lost))
    assert len(wrong) == 1 and wrong[0].startswith("rank 1: the largest frame holds"), wrong
    # a reduce-scatter the frames never issue (its moment lost): not the timeline's sequence
    unissued = copy.deepcopy(ranks)
    samples = unissued[1]["holdings"]
    samples.remove(next(h for h in samples if h["moment"] == "issue reduce_scatter"))
    wrong = animate.check(summary, unissued, animate.frames(summary, unissued))
    assert len(wrong) == 1 and wrong[0].startswith("rank 1: the frames issue"), wrong
    # an all-gather's bytes halved: the frames no longer send what the comm ledger counted
    halved = copy.deepcopy(ranks)
    gather = next(c for c in halved[0]["comm"] if c["name"] == "all_gather")
    gather["sent"] /= 2
    wrong = animate.check(summary, halved, animate.frames(summary, halved))
    assert len(wrong) == 1 and wrong[0].startswith("rank 0: the frames send"), wrong


def test_a_unit_never_freed_shows_at_the_end(recorded, tmp_path):
    """stage3.py with its frees after a unit's backward and before the step taken out: units stay gathered across
    the step, and the end frame draws them beside the ledger's parameter shard."""
    source = (ROOT / "stage3.py").read_text()
    slip = source.replace("            self._free(b)\n            # reduce-scatter", "            # reduce-scatter")
    slip = slip.replace("        for b in self.buckets:\n            self._free(b)\n", "")
    assert slip.count("self._free(b)") == source.count("self._free(b)") - 2
    (tmp_path / "stage3.py").write_text(slip)
    summary, ranks = recorded(tmp_path / "stage3.py")
    wrong = animate.check(summary, ranks, animate.frames(summary, ranks))
    assert [w.split(":")[0] for w in wrong if "the end frame draws" in w] == ["rank 0", "rank 1"], wrong


def test_the_command_draws_the_gif(tmp_path):
    """bench/README.md's command, published into tmp_path: its GIF has a frame for each frame drawn() keeps; --steps
    is refused in one line."""
    gif = tmp_path / "stage3.gif"
    cmd = [sys.executable, str(ROOT / "bench" / "animate.py"), "stage3.py", "--nproc", "2", "--preset", "tiny",
           "--dtype", "fp32", "--results", str(tmp_path / "results"), "--out", str(gif)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert p.returncode == 0, "\n".join(last_lines(p.stdout + p.stderr, 25))
    summary, ranks = animate.read(tmp_path / "stage3")
    data = animate.frames(summary, ranks)
    with Image.open(gif) as im:
        assert im.n_frames == len(animate.drawn(data))
    published = json.loads((tmp_path / "results" / "animate" / "stage3.frames.json").read_text())
    assert published["ranks"] == json.loads(json.dumps(ranks))
    refused = subprocess.run(cmd + ["--steps", "5"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "error: the animation is of a 2-step run's second step (the memory meter's and the timeline's): leave "
        "--steps out"]
    refused = subprocess.run(cmd + ["--device", "cuda"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "error: the animated step runs on the CPU, whose memory meter records every allocation: leave --device out"]


def test_the_published_animation_is_its_frames(tmp_path):
    """bench/results/animate/stage3.*: the frames of the published run pass every check, the page's table is theirs,
    and the GIF is drawn from them (its first and last frames drawn again here, pixel for pixel)."""
    folder = results.RESULTS / "animate"
    published = json.loads((folder / "stage3.frames.json").read_text())
    summary, ranks = published["summary"], published["ranks"]
    data = animate.frames(summary, ranks)
    assert animate.check(summary, ranks, data) == []
    body = (folder / "stage3.md").read_text().split("\n\n", 1)[1]
    assert body.strip() == animate.report(summary, data).strip(), "re-run bench/README.md's animate command"
    last = len(animate.drawn(data)) - 1
    animate.draw(summary, data, tmp_path / "again.gif", only=(0, last))
    with Image.open(folder / "stage3.gif") as shown, Image.open(tmp_path / "again.gif") as again:
        assert shown.n_frames == last + 1, "re-run bench/README.md's animate command"
        for k, j in ((0, 0), (last, 1)):
            shown.seek(k)
            again.seek(j)
            assert shown.convert("RGB").tobytes() == again.convert("RGB").tobytes(), (
                f"frame {k} of bench/results/animate/stage3.gif is not its frames': re-run the command")
