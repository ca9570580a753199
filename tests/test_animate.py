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
    # the optimizer's update has a frame of its own, on the captioned rank
    assert any(f["event"].startswith("the optimizer step is done") for f in animate.drawn(data))
    if script == "stage3.py":
        # live is the run's table's (the data set left out): stage 3's step ends holding its model states and little
        # else (what the meter has not yet seen freed, under load), so its live then is the table's (after backward)
        # to within half the data set, where counting the data set would put it a whole data set off
        end = {f["rank"]: f["ranks"][f["rank"]]["live"] for f in data}
        for r, live in end.items():
            table = summary["live_tensor_bytes_per_rank"][r]
            assert abs(live - table) < summary["data_bytes"] / 2, (
                f"rank {r}: the frames' live at the end {live:,} bytes, the table's {table:,}")
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
    if script == "stage3.py" and nproc > 1:
        assert {"[ZeRO-3]", "[Prefetch]", "[ZeRO-2]"} <= tags
    if nproc == 1:  # a world of one gathers and frees its units but calls no collective (comm.py): none is drawn
        assert "[ZeRO-3]" in tags and not any(r["sent"] for f in data for r in f["ranks"]), events


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
    """bench/README.md's command, published into tmp_path: it prints the frame list; its GIF has a frame for each frame
    drawn() keeps, each on screen as long as durations() says; --frames writes those frames as stills at least 1000
    pixels wide; the published frames name no path of this checkout; --steps, --device and a frame beyond the list
    are refused in one line."""
    gif = tmp_path / "stage3.gif"
    cmd = [sys.executable, str(ROOT / "bench" / "animate.py"), "stage3.py", "--nproc", "2", "--preset", "tiny",
           "--dtype", "fp32", "--out", str(gif)]
    p = subprocess.run(cmd + ["--frames", "2", "--results", str(tmp_path / "results")], capture_output=True,
                       text=True, cwd=ROOT, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert p.returncode == 0, "\n".join(last_lines(p.stdout + p.stderr, 25))
    summary, ranks = animate.read(tmp_path / "stage3")
    data = animate.frames(summary, ranks)
    shown = animate.drawn(data)
    listed = animate.frame_list(shown)
    assert "\n".join(listed) in p.stdout and listed[0].split()[0] == "1" and len(listed) == len(shown)
    with Image.open(gif) as im:
        assert im.n_frames == len(shown)
        times = []
        for k in range(im.n_frames):
            im.seek(k)
            times.append(im.info["duration"])
        assert times == animate.durations(shown) and max(times) > min(times)
    with Image.open(tmp_path / "results" / "animate" / "stage3.frame02.png") as still:
        assert still.width >= 1000, still.size
    text = (tmp_path / "results" / "animate" / "stage3.frames.json").read_text()
    published = json.loads(text)
    assert published["ranks"] == json.loads(json.dumps(ranks))
    assert str(ROOT) not in text and str(tmp_path) not in text, "the published frames name a path of this machine"
    refused = subprocess.run(cmd + ["--steps", "5"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "error: the animation is of a 2-step run's second step (the memory meter's and the timeline's): leave "
        "--steps out"]
    refused = subprocess.run(cmd + ["--device", "cuda"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "error: the animated step runs on the CPU, whose memory meter records every allocation: leave --device out"]
    beyond = len(shown) + 1
    refused = subprocess.run(cmd + ["--from_dir", "--frames", f"2,{beyond}"], capture_output=True, text=True, cwd=ROOT,
                             timeout=60)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        f"error: --frames {beyond}: this run draws {len(shown)} frames (listed above); pick numbers from 1 to "
        f"{len(shown)}"]


def readme_stills():
    """README.md's stills of the published animation: {frame number: what README says it shows}."""
    text = (ROOT / "README.md").read_text()
    return {int(k): alt for alt, k in re.findall(r"!\[([^\]]*)\]\(bench/results/animate/stage3\.frame(\d+)\.png\)",
                                                 text)}


def test_the_published_animation_is_its_frames(tmp_path):
    """bench/results/animate/stage3.*: the frames of the published run pass every check, the page's table is theirs;
    README's three stills are the frames it says (a unit gathered in forward, the peak with a gradient in flight, the
    end with the ledger's states inside the formula's outline), each drawn again here pixel for pixel; the GIF is
    drawn from the same frames (its first and last again here) and keeps the key frames on screen longer."""
    folder = results.RESULTS / "animate"
    published = json.loads((folder / "stage3.frames.json").read_text())
    summary, ranks = published["summary"], published["ranks"]
    data = animate.frames(summary, ranks)
    shown = animate.drawn(data)
    assert animate.check(summary, ranks, data) == []
    stills = readme_stills()
    body = (folder / "stage3.md").read_text().split("\n\n", 1)[1]
    assert body.strip() == animate.report(summary, data, sorted(stills)).strip(), "re-run bench/README.md's command"
    assert len(stills) == 3, stills
    gather, peak, end = (shown[k - 1] for k in sorted(stills))
    r = gather["rank"]
    assert "computes its forward" in gather["event"] and gather["ranks"][r]["flight"].get("params"), gather
    assert peak["moment"] == "the peak" and peak["ranks"][r]["flight"].get("grads"), peak
    assert end is shown[-1]
    assert {k: n for k, n in end["ranks"][r]["held"].items() if n} == {
        k: n for k, n in summary["model_state_bytes_per_rank"][r].items() if n}
    assert sum(end["ranks"][r]["held"].values()) <= sum(v["theory"] for v in summary["model_state_bytes"].values())
    animate.draw(summary, data, tmp_path / "again.gif", sorted(stills), tmp_path, only=(1, len(shown)))
    for k in stills:
        with Image.open(folder / f"stage3.frame{k:02d}.png") as shown_png, \
                Image.open(tmp_path / f"frame{k:02d}.png") as again:
            assert shown_png.convert("RGB").tobytes() == again.convert("RGB").tobytes(), (
                f"bench/results/animate/stage3.frame{k:02d}.png is not frame {k} of its frames: re-run the command")
    with Image.open(folder / "stage3.gif") as gif, Image.open(tmp_path / "again.gif") as again:
        assert gif.n_frames == len(shown), "re-run bench/README.md's animate command"
        for k, j in ((0, 0), (len(shown) - 1, 1)):
            gif.seek(k)
            again.seek(j)
            assert gif.convert("RGB").tobytes() == again.convert("RGB").tobytes(), (
                f"frame {k + 1} of bench/results/animate/stage3.gif is not its frames': re-run the command")
            assert gif.info["duration"] == animate.durations(shown)[k]


def test_the_checks_catch_planted_frames(recorded):
    """animate.check against planted frames (stage 3, N = 2): rank 0's first all-gather and first reduce-scatter
    swapped in time (the same collectives, in another order), and rank 1's ledger changed at the end (its end frame
    then differs from its own ledger, whatever rank 0's says)."""
    import copy
    summary, ranks = recorded(ROOT / "stage3.py")
    data = animate.frames(summary, ranks)
    assert animate.check(summary, ranks, data) == []
    swapped = copy.deepcopy(data)
    mine = [k for k, f in enumerate(swapped) if f["rank"] == 0 and f["moment"].startswith("issue ")]
    gather = next(k for k in mine if swapped[k]["moment"].split()[1] == "all_gather")
    scatter = next(k for k in mine if swapped[k]["moment"].split()[1] == "reduce_scatter")
    swapped[gather]["moment"], swapped[scatter]["moment"] = swapped[scatter]["moment"], swapped[gather]["moment"]
    wrong = animate.check(summary, ranks, swapped)
    assert any(w.startswith("rank 0: the frames issue") for w in wrong), wrong
    other = copy.deepcopy(summary)
    ledger = other["model_state_bytes_per_rank"][1]
    ledger["params"] += 2
    wrong = animate.check(other, ranks, data)
    assert any(w.startswith("rank 1: the end frame draws") for w in wrong), wrong
