"""The suite run on itself: one-line slips a student or a refactor could make, each planted in a copy of the
repository and run against only the tests that claim to catch it. A slip those tests pass is a hole in the suite.

    python tests/mutations.py              # every slip: a few minutes on 2 cores (each pytest session starts its runs)
    python tests/mutations.py lr_warmup    # the slips named
    python tests/mutations.py --list       # what each slip plants, and which tests claim it

Each slip replaces one exact piece of text (found exactly once, or the slip itself is out of date and says so) in a
copy of the working tree (tracked and untracked files, not those .gitignore names); then `python -m pytest -x` runs
the claiming tests there. Caught: they fail (exit code 1), and the first failing test is named. Not run by CI (each
slip starts its own runs); tests/README.md says when to run it."""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (file, the text as it is, the text with the slip, the tests that claim to catch it, what the slip is)
SLIPS = {
    "stage2_direct_all_reduce": (
        "stage2.py",
        "            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)\n",
        "            dist.all_reduce(b.grad, op=dist.ReduceOp.AVG)\n"
        "            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)\n",
        ["tests/test_stages.py::test_every_collective_goes_through_the_ledger[stage2-2]"],
        "an extra all-reduce of every bucket, called on torch.distributed directly (numbers unchanged)"),
    "lr_warmup_off_by_one": (
        "train_gpt.py", "        return args.lr * (step + 1) / args.warmup\n",
        "        return args.lr * step / args.warmup\n",
        ["tests/test_shared.py"], "lr_at's warmup one step late (step 0 trains with lr 0)"),
    "adam_step_off_by_one": (
        "train_gpt.py", "        self.step_tensor.fill_(self.t)\n", "        self.step_tensor.fill_(self.t + 1)\n",
        ["tests/test_adamw.py"], "AdamW's bias correction one step ahead"),
    "stage1_fp32_copy": (
        "stage1.py", "        self.optimizer = AdamW(self.master, args)\n",
        "        self.optimizer = AdamW(self.master, args)\n"
        "        self.copy = torch.cat([b.param for b in self.buckets]).float()\n",
        ["tests/test_stages.py::test_freed_what_the_stage_promises[stage1-2]"],
        "stage 1 keeps a whole fp32 copy of the parameters outside model_states() (4Ψ per rank)"),
    "readme_stage0_number": (
        "README.md", "model states read 2.08 MiB per rank", "model states read 1.08 MiB per rank",
        ["tests/test_readme.py::test_stage0_model_states_of_the_first_command"], "README's stage-0 number changed"),
    "readme_stage3_table": (
        "README.md", "|     1.04 |     1.05 |     0.01 |     6.98", "|     1.14 |     1.05 |     0.01 |     6.98",
        ["tests/test_commands.py::test_first_command"], "README's sample table's stage-3 states changed"),
    "compare_k_of_n_always_n": (
        "bench/compare.py", '    exact = sum(r["states_measured"] == r["states_theory"] for r in rows)\n',
        "    exact = len(rows)\n",
        ["tests/test_shared.py::test_compare_counts_runs_that_disagree"],
        "bench/compare.py's \"equal to the formula in k of n runs\" always n of n"),
    "stage2_sum_for_avg": (
        "stage2.py",
        "            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)\n",
        "            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.SUM, async_op=True)\n",
        ["tests/test_stages.py::test_parity_with_reference[stage2-2]"], "stage 2's gradients summed, not averaged"),
    "comm_calls_in_a_world_of_one": (
        "comm.py", "        if dist.get_world_size() > 1:\n            return False\n",
        "        if dist.get_world_size() > 0:\n            return False\n",
        ["tests/test_stages.py::test_every_collective_goes_through_the_ledger[stage3-1]"],
        "a world of one calls its collectives (each a host cost on a GPU, for a result that is a copy)"),
    "offload_step_waits_for_copies": (
        "offload.py", "        coef = clip_coef(norm, self.args.grad_clip, scaler)\n        self.outside.order.check()\n",
        "        self.copies.landed()\n        coef = clip_coef(norm, self.args.grad_clip, scaler)\n"
        "        self.outside.order.check()\n",
        ["tests/test_timeline.py::test_compute_waiting_for_copies_is_a_wait"],
        "offload's step waits on the host for its copies, though its read of the norm finds them landed"),
    "offload_gpu_adam_under_backward_only": (
        "bench/offload_gpu.py", '("cpu adam", ("forward", "backward"), "")', '("cpu adam", ("backward",), "")',
        ["tests/test_offload_gpu.py::test_overlap_fractions_on_a_made_up_trace"],
        "the bench counts the C++ AdamW's overlap under backward's kernels only (forward's left out)"),
    "offload_gpu_ratio_inverted": (
        "bench/offload_gpu.py", "ratio = lambda name: f\"{tf[name] / tf['stage0']:.2f}\"",
        "ratio = lambda name: f\"{tf['stage0'] / tf[name]:.2f}\"",
        ["tests/test_offload_gpu.py::test_the_table_divides_offload_by_stage0"],
        "the table's offload / stage 0 column printed as stage 0 / offload"),
    "dpu_update_reads_the_filling_shard": (
        "offload.py", "self._cpu_update, self.spare_grad_shard, landed", "self._cpu_update, self.grad_shard, landed",
        ["tests/test_offload.py::test_delayed_update_is_exactly_one_step_stale[1]"],
        "--delayed_update's thread reads the gradient shard the next step fills, not the one that came down"),
    "offload_norm_on_the_host": (
        "offload.py", "        norm = self.squares.sum()\n",
        "        self.copies.landed()\n        norm = self.buckets[0].param.new_full((), "
        "self.adam.sum_of_squares(self.grad_shard), dtype=torch.float64)\n",
        ["tests/test_offload.py::test_the_step_passes_over_the_host_gradient_once"],
        "the global norm summed on the host, a second pass over the gradient shard beside AdamW's (the same norm)"),
    "offload_zeroes_the_host_shard": (
        "offload.py", "        if self.grad_acc is not None:\n            self.grad_acc.zero_()\n",
        "        if self.grad_acc is not None:\n            self.grad_acc.zero_()\n        self.grad_shard.zero_()\n",
        ["tests/test_offload.py::test_the_step_passes_over_the_host_gradient_once"],
        "the host's gradient shard zeroed after each step, though the next copies down overwrite all of it"),
    "dpu_host_waits_for_the_upload": (
        "offload.py", "                self.param_shard, self.next_param_shard = self.next_param_shard, self.param_shard\n",
        "                self.param_shard, self.next_param_shard = self.next_param_shard, self.param_shard\n"
        "                self.copies.landed()\n",
        ["tests/test_end_of_run.py::test_one_host_sync_per_step[offload.py --delayed_update-0-6]"],
        "--delayed_update's training thread waits on the host for the parameters' copies up (the paper's DPU: never)"),
    "offload_dropped_accumulation": (
        "offload.py", "                b.reduced = self.grad_acc[where].add_(b.reduced)",
        "                b.reduced = self.grad_acc[where].copy_(b.reduced)", ["tests/test_stages.py::test_parity_with_reference[offload-2]"],
        "offload keeps only the last micro-step's gradient shard (--grad_accum's sum dropped)"),
    "stage2_missed_all_gather": (
        "stage2.py",
        "        for b in self.buckets:\n"
        "            comm.all_gather(b.param, self.master[self._shard_range(b)].to(b.param.dtype))\n"
        "        # [/ZeRO-1]\n",
        "        for b in self.buckets:\n"
        "            pass\n"
        "        # [/ZeRO-1]\n",
        ["tests/test_stages.py::test_parity_with_reference[stage2-2]"],
        "stage 2's step never all-gathers the updated shards into the parameters"),
    "offload_grad_acc_unlisted": (
        "offload.py", '        summed = {"grad_acc": [self.grad_acc]} if self.grad_acc is not None else {}\n',
        "        summed = {}\n",
        ["tests/test_course.py::test_every_step_keeps_its_own_ledger[offload.py - Copy stream - ZeRO-3 Offload - DPU - "
         "NVMe-2]"],
        "offload's model_states() leaves out the device buffer that sums the micro-steps (lesson 6's step file)"),
    "copy_stream_is_the_compute_stream": (
        "offload.py", "        self.stream = torch.cuda.Stream(device)\n",
        "        self.stream = torch.cuda.current_stream(device)\n",
        ["tests/test_ideas.py::test_the_idea_is_there[offload-Copy_stream]"],
        "CopyStream queues its copies on the compute stream: no copy stream (graded by idea)"),
    "offload_dropped_clipping": (
        "offload.py", "self.staging[where], step=step, lr=lr, grad_scale=coef,\n",
        "self.staging[where], step=step, lr=lr, grad_scale=1.0,\n",
        ["tests/test_fp16.py::test_fp16_parity_and_ledgers[offload]"],
        "offload's C++ AdamW called without the clipping coefficient"),
    "adamw_recipe_without_weight_decay": (
        "train_gpt.py", "eps=eps, weight_decay=args.weight_decay)", "eps=eps, weight_decay=0.0)",
        ["tests/test_adamw.py"],
        "AdamW's recipe (train_gpt's fused step, and offload's C++ one) loses its weight decay"),
    "other_meter_zero": (
        "instruments.py", "    other = live - storage_bytes(on_device)\n", "    other = 0\n",
        ["tests/test_stages.py::test_freed_what_the_stage_promises[stage0_ddp-2]"],
        "the meter of tensors beyond model states forced to zero"),
    "peak_meter_net_change": (
        "instruments.py", "        self.peak = self.base + highest\n", "        self.peak = self.base + running\n",
        ["tests/test_shared.py"], "the peak meter reports the net change over the window, not its high-water mark"),
    "formula_master_bytes": (
        "train_gpt.py", "b.update(master=4, adam_m=4", "b.update(master=6, adam_m=4",
        ["tests/test_estimate.py::test_estimate_equals_model_state_theory"],
        "the formula's fp32 master at 6 bytes a parameter (bench/estimate.py follows it)"),
    "compare_total_without_grad_acc": (
        "bench/compare.py", 'states_measured=sum(v.get("measured", 0) for v in msb.values()),',
        "states_measured=sum(meas.values()),",
        ["tests/test_offload.py::test_compare_counts_the_accumulated_shard"],
        "bench/compare.py's model-state total only the columns' (offload's grad_acc dropped)"),
    "nvme_no_free_space_check": (
        "nvme.py", "        if free < self.nbytes:\n", "        if False:\n",
        ["tests/test_nvme.py::test_too_little_free_space_is_refused"],
        "the state file's free-space check dropped (the disk fills in the middle of a step instead)"),
    "nvme_no_missing_directory_check": (
        "nvme.py", "        if not os.path.isdir(directory):\n", "        if False:\n",
        ["tests/test_nvme.py::test_missing_directory_is_refused"],
        "a missing nvme path refused as not writable, without the mkdir that fixes it"),
    "nvme_no_o_direct": (
        "nvme.py", "            self.fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)\n",
        "            self.fd = os.open(self.path, os.O_RDWR)\n",
        ["tests/test_nvme.py::test_o_direct_on_this_disk"],
        "the state file opened without O_DIRECT (through the page cache)"),
    "nvme_no_buffered_fallback": (
        "nvme.py", "        except OSError as e:\n            self.fd = buffered\n",
        "        except OSError as e:\n            raise\n            self.fd = buffered\n",
        ["tests/test_nvme.py::test_buffered_where_o_direct_is_refused"],
        "a filesystem that refuses O_DIRECT stops the run instead of falling back to a buffered file"),
    "nvme_not_reserved": (
        "nvme.py", "            os.posix_fallocate(fd, 0, self.nbytes)\n",
        "            os.ftruncate(fd, self.nbytes)\n",
        ["tests/test_nvme.py::test_round_trip_is_bit_exact"], "the state file sparse: its blocks not reserved"),
    "nvme_offset_ignored": (
        "nvme.py", "                moved = call(self.fd, [memory[done:]], offset + done)\n",
        "                moved = call(self.fd, [memory[done:]], done)\n",
        ["tests/test_nvme.py::test_round_trip_is_bit_exact"], "every transfer at the file's start"),
    "nvme_short_transfer_ignored": (
        "nvme.py", "            done += moved\n", "            done = len(memory)\n",
        ["tests/test_nvme.py::test_short_transfers_go_on"], "a short read or write taken as complete"),
    "nvme_os_error_raw": (
        "nvme.py", "                self._fail(op, offset, len(memory), e.errno, e.strerror)\n",
        "                raise\n",
        ["tests/test_nvme.py::test_io_error_is_one_line"],
        "an I/O error surfaces as the bare OSError: no file, operation or offset named"),
    "nvme_enospc_unnamed": (
        "nvme.py", '            reason = "disk full"\n', "            pass\n",
        ["tests/test_nvme.py::test_io_error_is_one_line"],
        "a full disk reported by ENOSPC's strerror, not as 'disk full'"),
    "nvme_close_does_not_wait": (
        "nvme.py", "        self.pool.shutdown(wait=True)\n", "        self.pool.shutdown(wait=False)\n",
        ["tests/test_nvme.py::test_close_waits_and_removes"],
        "close() closes the file under the writes still in flight"),
    "nvme_close_keeps_the_file": (
        "nvme.py", "        if remove:\n", "        if False:\n",
        ["tests/test_nvme.py::test_close_waits_and_removes"], "close() leaves the state file on disk"),
    "nvme_shared_name": (
        "nvme.py", 'f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.states"', 'f"{name}.states"',
        ["tests/test_nvme.py::test_close_waits_and_removes"], "two state files of one name in one directory collide"),
    "nvme_one_bucket": (
        "offload.py", "        master, exp_avg, exp_avg_sq = self.disk.states(k)\n",
        "        master, exp_avg, exp_avg_sq = self.disk.states(0)\n",
        ["tests/test_nvme_tier.py::test_bit_identical_to_the_states_in_memory[fp32-N1]"],
        "the NVMe tier updates every bucket with the first bucket's states"),
    "nvme_no_write_back": (
        "offload.py", "grad_scale=coef, **self.optimizer.recipe)\n        self.disk.write(k)\n",
        "grad_scale=coef, **self.optimizer.recipe)\n",
        ["tests/test_nvme_tier.py::test_bit_identical_to_the_states_in_memory[fp32-N1]"],
        "the NVMe tier never writes the updated states back"),
    "nvme_resume_not_on_disk": (
        "offload.py", "        self.disk.scatter(self.held)\n",
        "        pass\n",
        ["tests/test_nvme_tier.py::test_checkpoints_move_between_the_tiers"],
        "a checkpoint loaded into the NVMe tier never reaches its file"),
    "nvme_states_made_in_memory": (
        "offload.py", "        self.disk.scatter([self.param_shard, zeros, zeros])\n",
        "        self.disk.scatter([super()._host_master(), torch.zeros(self.param_shard.numel()),\n"
        "                           torch.zeros(self.param_shard.numel())])\n",
        ["tests/test_largest.py::test_zero3_construction_never_holds_the_whole_model[offload_nvme]"],
        "the NVMe tier makes its states in host memory (12Ψ/N at once) before writing them out"),
    "largest_host_without_buffers": (
        "bench/largest.py", '            charged = meter.peak - meter.base - held["device"] + held["mapped"]\n',
        '            charged = meter.peak - meter.base - held["device"]\n',
        ["tests/test_largest.py::test_largest_host"],
        "bench/largest.py --limit host leaves the NVMe tier's mapped buffers out of the host's peak"),
    "nvme_no_word_left": (
        "nvme.py", "        leave_word(message)\n", "",
        ["tests/test_nvme_tier.py::test_a_full_disk_on_one_rank_stops_every_rank_with_its_line"],
        "a rank the disk failed stops alone: the others guess at the cause (uneven data)"),
    "nvme_files_left": (
        "offload.py", "            self.disk.close()\n", "            pass\n",
        ["tests/test_nvme_tier.py::test_bit_identical_to_the_states_in_memory[fp32-N1]"],
        "the state files stay on disk after the run"),
    "nvme_unaligned_buffer": (
        "nvme.py", "    return torch.frombuffer(mmap.mmap(-1, round_up(nbytes)), dtype=torch.uint8)\n",
        "    return torch.empty(round_up(nbytes), dtype=torch.uint8)\n",
        ["tests/test_nvme.py::test_aligned_buffers"], "aligned() takes the allocator's block, not a page-aligned one"),
    "nvme_layout_of_equal_buckets": (
        "nvme.py", "        self.offsets = [sum(self.sizes[:k]) for k in range(len(numels))]\n",
        "        self.offsets = [k * self.sizes[0] for k in range(len(numels))]\n",
        ["tests/test_nvme.py::test_disk_states_of_unequal_buckets_through_one_buffer"],
        "the state file's layout assumes every bucket the first's size (a larger one overlaps the next)"),
    "train_step_lr_of_the_next_step": (
        "train_gpt.py", "        grad_norm = engine.step(lr_at(step, args), scaler)",
        "        grad_norm = engine.step(lr_at(step + 1, args), scaler)",
        ["tests/test_shared.py::test_train_step_uses_lr_at_of_its_own_step"],
        "train_step asks the schedule for the next step's lr (warmup's first step skipped, in every stage alike)"),
    "scaler_doubles_before_the_clip_coef": (
        "train_gpt.py",
        "    norm = norm / scaler.scale\n"
        "    coef = ((max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm))"
        " / scaler.scale\n"
        "    scaler.update(True)\n",
        "    scaler.update(True)\n"
        "    norm = norm / scaler.scale\n"
        "    coef = ((max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm))"
        " / scaler.scale\n",
        ["tests/test_fp16.py::test_clip_coef_at_the_scalers_window_divides_by_the_scale_the_gradient_has"],
        "the loss scale doubles before the clip coefficient divides by it (each window's last step half a gradient)"),
    "fp16_norm_logged_scaled": (
        "train_gpt.py", "        grad_norm = engine.step(lr_at(step, args), scaler).double() / scale ",
        "        grad_norm = engine.step(lr_at(step, args), scaler).double() ",
        ["tests/test_fp16.py::test_fp16_logs_the_true_gradient_norm"],
        "fp16's logged gradient norm left multiplied by the loss scale"),
    "nvme_host_copy_kept": (
        "offload.py",
        "        if k == 0:\n"
        "            self.held = None\n", "",
        ["tests/test_nvme_tier.py::test_a_saves_host_copy_of_the_states_goes_at_the_next_update"],
        "the NVMe tier keeps a checkpoint's host copy of the states (12Ψ/N) for the rest of the run"),
    "nvme_checkpoint_from_the_buffer": (
        "nvme.py", "            for state, view in zip(held, self.states(k)):\n",
        "            for state, view in zip(held, self.buffer(k)):\n",
        ["tests/test_nvme_tier.py::test_checkpoints_move_between_the_tiers",
         "tests/test_nvme_tier.py::test_a_rank_killed_mid_step_resumes_bit_for_bit",
         "tests/test_nvme_tier.py::test_a_full_disk_mid_run_stops_with_one_line"],
        "the NVMe tier's checkpoint reads each bucket's states from its buffer, not from the file"),
    "stage3_prefetch_of_a_finished_backward": (
        "stage3.py", "        after = [n for n in order[order.index(b) + 1:] if n.waiting or not backward]\n",
        "        after = order[order.index(b) + 1:]\n",
        ["tests/test_call_patterns.py::test_each_unit_gathered_once_a_call_and_once_for_its_backward"],
        "stage 3's backward prefetches a unit whose backward is over (gathered again, it stays until the step)"),
    "stage3_use_after_backward_is_over": (
        "stage3.py",
        "            require(any(n.waiting for n in self.buckets), Misuse.OUTSIDE_BACKWARD)\n            return\n",
        "            require(any(n.waiting for n in self.buckets), Misuse.OUTSIDE_BACKWARD)\n",
        ["tests/test_call_patterns.py::test_each_unit_gathered_once_a_call_and_once_for_its_backward"],
        "stage 3 gathers a unit whose backward is over when a gradient reaches another of its outputs"),
    "stage3_no_wait_before_use": (
        "stage3.py", "        self._gather(b)\n        self._wait(b)\n", "        self._gather(b)\n",
        ["tests/test_call_patterns.py::test_parameters_are_used_after_their_gather_lands"],
        "stage 3's unit computes on parameters whose all-gather has not landed (no wait() before use)"),
    "stage3_gradient_reduced_twice": (
        "stage3.py",
        "            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)\n",
        "            comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG)\n"
        "            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)\n",
        ["tests/test_stages.py::test_communication_bytes_match_formula[stage3-2]"],
        "stage 3 reduce-scatters each bucket twice (the numbers unchanged: the same average twice)"),
    "offload_prefetch_of_a_finished_backward": (
        "offload.py", "        after = [n for n in order[order.index(b) + 1:] if n.waiting or not backward]\n",
        "        after = order[order.index(b) + 1:]\n",
        ["tests/test_call_patterns.py::test_each_unit_gathered_once_a_call_and_once_for_its_backward"],
        "offload's backward prefetches a unit whose backward is over (gathered again, it stays until the step)"),
    "largest_nvme_headline_formula": (
        "bench/largest.py", "        ram, disk = 12 + 2 * param, 2 * param",
        "        ram, disk = 12 + 2 * param, param",
        ["tests/test_docs.py::test_largest_headline_states_the_codes_formulas"],
        "bench/largest.py's NVMe headline divides by the parameters alone (16Ψ against 2Ψ, 8.0x), staging forgotten"),
    "largest_nvme_headline_wrong_base": (
        "bench/largest.py", "{get['offload_nvme', 1] / get['offload', 1]:.2f}x",
        "{get['offload_nvme', 1] / get['offload', 2]:.2f}x",
        ["tests/test_docs.py::test_published_largest_numbers_follow_their_tables"],
        "bench/largest.py's NVMe headline measures against offload at N=2"),
    "readme_nvme_disk_formula": (
        "README.md", "host 2Ψ/N + buffers, disk 12Ψ/N", "host 2Ψ/N + buffers, disk 16Ψ/N",
        ["tests/test_readme.py::test_offload_and_nvme_numbers_are_the_codes"], "README's NVMe row puts 16Ψ/N on disk"),
    "readme_nvme_headline": (
        "README.md", "master and moments (12Ψ/N) live in a file", "master and moments (16Ψ/N) live in a file",
        ["tests/test_readme.py::test_offload_and_nvme_numbers_are_the_codes"],
        "README's NVMe paragraph puts another formula than the code's on the disk"),
    "bench_readme_nvme_ratio": (
        "bench/README.md", "tier trains 3.49x offload's", "tier trains 3.94x offload's",
        ["tests/test_docs.py::test_bench_readme_numbers_are_the_results"],
        "bench/README.md's sentence on the NVMe tier's result not its table's ratio"),
    "checkpoint_rename_before_fsync": (
        "checkpoint.py", "        os.fsync(f.fileno())  # the bytes are on disk before the name points at them\n", "",
        ["tests/test_checkpoint.py::test_a_save_is_on_disk_before_a_name_points_at_it"],
        "a checkpoint file renamed into place before its bytes are on disk"),
    "checkpoint_manifest_before_the_shards_rename": (
        "checkpoint.py", "    if rank == 0:\n        fsync_dir(where)\n", "    if rank == 0:\n",
        ["tests/test_checkpoint.py::test_a_save_is_on_disk_before_a_name_points_at_it"],
        "the manifest named before the shards' renames are on disk"),
    "checkpoint_manifest_rename_not_synced": (
        "checkpoint.py", "        fsync_dir(where)\n        # the step directory's", "        # the step directory's",
        ["tests/test_checkpoint.py::test_a_save_is_on_disk_before_a_name_points_at_it"],
        "the manifest's rename never fsynced (a power cut may lose the newest checkpoint)"),
    "checkpoint_step_directory_not_synced": (
        "checkpoint.py", "        fsync_dir(ckpt_dir)\n", "",
        ["tests/test_checkpoint.py::test_a_save_is_on_disk_before_a_name_points_at_it"],
        "older checkpoints removed while the new step directory's name may not be on disk yet"),
    "bench_nvme_ratio_verdict_reversed": (
        "bench/bench_nvme.py", '"met" if round(r, 2) <= GOAL_RATIO', '"met" if round(r, 2) >= GOAL_RATIO',
        ["tests/test_nvme.py::test_tier_table_arithmetic"],
        "bench_nvme's step-ratio verdict says met where the goal is missed"),
    "bench_nvme_bound_min": (
        "bench/bench_nvme.py", "    bound = max(adam, io)\n", "    bound = min(adam, io)\n",
        ["tests/test_nvme.py::test_tier_table_arithmetic"],
        "bench_nvme measures a step's extra cost against the smaller of AdamW and the I/O time"),
    "bench_nvme_share_of_the_wrong_disk": (
        "bench/bench_nvme.py", "            share = t[op] / 1e6 / own\n",
        "            share = t[op] / 1e6 / read_disk\n",
        ["tests/test_nvme.py::test_tier_table_arithmetic"],
        "bench_nvme's write bandwidth share taken against the disk's read bandwidth"),
    "bench_nvme_beyond_forward_backward": (
        "bench/bench_nvme.py", '(t["step"] - (ram["step"] - adam)) / bound', '(t["step"] - ram["step"]) / bound',
        ["tests/test_nvme.py::test_tier_table_arithmetic"],
        "bench_nvme's step less forward and backward subtracts the whole step in RAM"),
    "memory_table_step_fixed": (
        "instruments.py", "measured on step {s['measured_step']}; {where}", "measured on step 1; {where}",
        ["tests/test_checkpoint.py::test_reference_stop_and_resume_is_exact"],
        "the memory table names step 1 whichever step its meter measured (a resumed run's, the log's count)"),
    "grader_stage3_without_recompute": (
        "tests/test_ideas.py", '"stage3": 5, "offload": 10', '"stage3": 4, "offload": 10',
        ["tests/test_ideas.py::test_the_graders_own_configuration_is_the_ladders"],
        "the grader expects stage 3 without its Recompute idea"),
    "grader_zero2_checks_the_master": (
        "tests/test_ideas.py", '"ZeRO-2": ("stage2", ["grads"])', '"ZeRO-2": ("stage2", ["master"])',
        ["tests/test_ideas.py::test_the_graders_own_configuration_is_the_ladders"],
        "the grader checks ZeRO-2 on the master weights (ZeRO-1's) instead of the gradients"),
    "dpu_save_without_landing_the_update": (
        "offload.py", "        # the update in flight lands first (a one-step shift)\n        self._finish_update()\n",
        "",
        ["tests/test_offload.py::test_delayed_update_stopped_and_resumed_at_two_ranks"],
        "--delayed_update saves while its CPU update is in flight (the checkpoint a step behind, or torn)"),
    "nvme_save_without_landing_the_update": (
        "offload.py", "        self._finish_update()\n        # the states, read into host memory for a checkpoint",
        "        # the states, read into host memory for a checkpoint",
        ["tests/test_nvme_tier.py::test_a_delayed_update_saved_mid_update_resumes_as_the_straight_run"],
        "the NVMe tier's checkpoint reads the state file while --delayed_update's CPU update is still writing it"),
    "sharded_freed_check_skips_lists": (
        "outside.py", "for x in (a if isinstance(a, (list, tuple)) else [a])]", "for x in [a]]",
        ["tests/test_any_model.py::test_a_freed_parameter_inside_an_ops_arguments_names_itself"],
        "a freed parameter passed inside a list or tuple (torch.cat([w])) is read, not named"),
    "sparse_refusal_of_the_roots_children_only": (
        "options.py", "    for name, m in model.named_modules():\n        if getattr(m, \"sparse\"",
        "    for name, m in model.named_children():\n        if getattr(m, \"sparse\"",
        ["tests/test_any_model.py::test_a_nested_sparse_module_is_refused"],
        "the sparse refusal looks only at the root's children (a nested nn.EmbeddingBag(sparse=True) is trained)"),
    "sparse_refusal_of_a_frozen_module": (
        "options.py", " is True and any(p.requires_grad for p in m.parameters(recurse=False)):", " is True:",
        ["tests/test_any_model.py::test_a_nested_sparse_module_is_refused"],
        "a frozen nn.EmbeddingBag(sparse=True), which makes no gradient, refused as if trained"),
    "progress_tflops_not_per_rank": (
        "instruments.py", "        rate = speed(self.flops, tok_s, self.world_size, self.device, args.dtype)\n",
        "        rate = speed(self.flops, tok_s, 1, self.device, args.dtype)\n",
        ["tests/test_flops.py::test_progress_lines_and_report_agree_at_two_ranks"],
        "the progress line's TFLOP/s per rank not divided by the ranks (2x the report's at N = 2)"),
    "report_tflops_not_per_rank": (
        "instruments.py", "**speed(run.flops, tokens_per_s, run.world_size, run.device, args.dtype),",
        "**speed(run.flops, tokens_per_s, 1, run.device, args.dtype),",
        ["tests/test_flops.py::test_progress_lines_and_report_agree_at_two_ranks"],
        "the report's TFLOP/s per rank not divided by the ranks (2x the progress lines' at N = 2)"),
    "fake_cuda_in_place_slice_at_any_offset": (
        "tests/fake_cuda.py", "                and part.storage_offset() * part.element_size() == start\n", "",
        ["tests/test_fake_cuda.py::test_an_in_place_all_gather_from_another_ranks_slice_is_refused"],
        "the fake device takes an in-place collective's input as the rank's slice at any offset of the output"),
    "gpu_picked_by_the_global_rank": (
        "devices.py", '    device = pick_device(args.device, int(os.environ["LOCAL_RANK"]))\n',
        '    device = pick_device(args.device, int(os.environ["RANK"]))\n',
        ["tests/test_fake_cuda.py::test_two_nodes_each_rank_on_its_nodes_gpu"],
        "each rank's GPU picked by its global RANK, not LOCAL_RANK (right on one node, wrong on the second of two)"),
    "outside_kept_across_forwards": (
        "outside.py", "        model.register_forward_pre_hook(lambda m, inputs: self.kept.clear())\n", "",
        ["tests/test_any_model.py::test_a_unit_kept_by_one_forward_is_freed_in_the_next"],
        "a unit kept gathered by one forward's outside read stays kept in every later forward"),
    "timeline_nvme_wait_named_as_adams": (
        "instruments.py", '            return TimedFuture(future, self, f"wait nvme {name}")\n',
        "            return TimedFuture(future, self)\n",
        ["tests/test_timeline.py::test_nvme_reads_run_beside_adam"],
        "the timeline draws the host's wait for an NVMe transfer as a wait for --delayed_update's thread"),
    "timeline_copies_named_the_other_way": (
        "instruments.py", 'enter, leave = down if dst.device.type == "cpu" else up',
        'enter, leave = down if src.device.type == "cpu" else up',
        ["tests/test_gpu_check.py::test_gpu_check_without_a_gpu"],
        "the timeline names offload's copies to the host as copies to the device, and the other way round"),
    "beta_of_one_accepted": (
        "options.py", "        if not 0 <= getattr(args, name) < 1:\n",
        "        if not 0 <= getattr(args, name) <= 1:\n",
        ["tests/test_inputs.py::test_recipe_options_are_refused_in_one_line"],
        "--beta2 1 accepted (Adam's bias correction divides by zero: every weight NaN)"),
    "nan_rate_accepted": (
        "options.py", "        if not getattr(args, name) >= 0:  # (NaN too)\n",
        "        if getattr(args, name) < 0:  # (NaN too)\n",
        ["tests/test_inputs.py::test_recipe_options_are_refused_in_one_line"], "--lr nan accepted"),
    "gpu_past_the_nodes_last": (
        "devices.py", "    if local_rank >= torch.cuda.device_count():\n",
        "    if local_rank > torch.cuda.device_count():\n",
        ["tests/test_gpu_path.py::test_each_local_rank_takes_its_gpu_and_one_too_many_is_refused"],
        "a local rank one past the node's last GPU is given that GPU (CUDA's invalid device ordinal at start)"),
    "outside_read_inside_its_own_unit_keeps_it": (
        "outside.py", " and self.running.get(self.model) and not self.running.get(b.module):",
        " and self.running.get(self.model):",
        ["tests/test_any_model.py::test_a_unit_kept_by_one_forward_is_freed_in_the_next"],
        "a unit's own forward reading its parameter (self.weight) keeps it gathered past its forward, every unit"),
    "fake_cuda_gather_list_compared_across_ranks": (
        "tests/fake_cuda.py", '    rooted = [n for n, _ in named if n.startswith(("gather_list", "scatter_list"))]\n',
        "    rooted = []\n",
        ["tests/test_gpu.py::test_gpu_ledgers_device_and_host[stage1-2]"],
        "the fake device compares a gather's list of outputs across ranks (the root's alone): gather_master refused"),
    "outside_read_outside_forward_gathers": (
        "outside.py", "        if b is not None and self.running.get(self.model) and not",
        "        if b is not None and not",
        ["tests/test_any_model.py::test_a_freed_parameter_used_names_itself"],
        "a read outside engine.forward gathers the unit (a collective one rank's read would hang the others on)"),
    "outside_dataclass_outputs_unwalked": (
        "outside.py", "    return [t for t in found + torch.utils._pytree.tree_leaves(fields) if",
        "    return [t for t in found if",
        ["tests/test_call_patterns.py::test_call_pattern_trains_as_the_reference[stage3-structured outputs]"],
        "a forward's output walked without the tensors inside its dataclasses"),
    "meter_blind_to_wrapped_tensors": (
        "instruments.py", "    if is_traceable_wrapper_subclass(t):\n", "    if False:\n",
        ["tests/test_shared.py::test_memory_meter_reads_a_wrapper_through_the_tensor_it_holds"],
        "the memory meter counts nothing of a wrapper subclass (DTensor: FSDP2's parameters and moments)"),
    "pinned_theory_without_the_spare_shard": (
        "instruments.py", "(2 + delayed_update + offload_params)", "(2 + offload_params)",
        ["tests/test_estimate.py::test_pinned_memory_as_pytorch_allocates_it"],
        "the pinned-memory formula leaves out --delayed_update's second gradient shard"),
    "n_embd_not_divisible_accepted": (
        "options.py", "    if cfg.n_embd % cfg.n_head:\n", "    if False:\n",
        ["tests/test_inputs.py::test_bad_input_one_line_error"],
        "--n_embd that --n_head does not divide accepted (a traceback in the attention's view)"),
    "batch_divisible_by_the_ranks_alone": (
        "options.py", "    if args.batch_size % (world_size * args.grad_accum):\n",
        "    if args.batch_size % world_size:\n",
        ["tests/test_inputs.py::test_bad_input_one_line_error"],
        "a batch that N divides but N x --grad_accum does not accepted"),
    "nvme_no_buffer_accepted": (
        "options.py", "    if nvme and args.nvme_buffer_count < 1:\n", "    if nvme and args.nvme_buffer_count < 0:\n",
        ["tests/test_nvme_tier.py::test_bad_paths_get_one_line"], "--nvme_buffer_count 0 accepted"),
    "adam_threads_every_core_per_rank": (
        "devices.py", "    return max(1, cores // local - spare), cores, local\n",
        "    return max(1, cores - spare), cores, local\n",
        ["tests/test_cpu_adam.py::test_threads_are_the_ranks_share_of_the_cores"],
        "every local rank's C++ AdamW takes every core of the node"),
    "nvme_read_over_a_write_in_flight": (
        "nvme.py", "        if write is not None:\n            write.result()\n", "",
        ["tests/test_nvme.py::test_disk_states_of_unequal_buckets_through_one_buffer"],
        "a bucket read into a buffer whose last write is still in flight"),
    "nvme_read_kept_after_use": (
        "nvme.py", "        self.reads.pop(k).result()\n", "        self.reads[k].result()\n",
        ["tests/test_nvme.py::test_disk_states_of_unequal_buckets_through_one_buffer"],
        "a bucket's finished read taken as this step's (its buffer since overwritten by another bucket)"),
    "nvme_buffers_not_per_rank": (
        "nvme.py", "    return buffer_count * round_up(12 * largest_bucket // world_size)\n",
        "    return buffer_count * round_up(12 * largest_bucket)\n",
        ["tests/test_nvme_tier.py::test_bit_identical_to_the_states_in_memory[fp32-N2-one_buffer]"],
        "the NVMe tier's buffer formula sized for the whole bucket, not the rank's shard of it"),
    "timeline_union_merges_gaps": (
        "bench/timeline.py", "        if out and a <= out[-1][1]:\n", "        if out:\n",
        ["tests/test_timeline.py::test_printed_overlaps_of_every_row_are_the_traces[stage0]"],
        "bench/timeline.py's union of intervals bridges the gaps between them"),
    "timeline_intersection_steps_both": (
        "bench/timeline.py", "        if xs[i][1] < ys[j][1]:\n            i += 1\n        else:\n            j += 1\n",
        "        i += 1\n        j += 1\n",
        ["tests/test_timeline.py::test_printed_overlaps_of_every_row_are_the_traces[stage0]"],
        "bench/timeline.py's intersection steps past both intervals at once (overlaps lost)"),
    "timeline_begun_in_ignored": (
        "bench/timeline.py", '        begun = begun_in is None or e["ts"] < ends.get(e["pid"], 0)\n',
        "        begun = True\n",
        ["tests/test_gpu.py::test_overlap_fractions_on_a_made_up_timeline"],
        "under_phases counts a copy begun after backward's last kernel as a gradient copy of backward"),
    "fake_cuda_object_syncs_not_set_apart": (
        "tests/fake_cuda.py", '    seen["host syncs in object collectives"] += flags.objects',
        '    seen["host syncs in object collectives"] += 0',
        ["tests/test_end_of_run.py::test_one_host_sync_per_step[stage1.py-1-20]"],
        "the fake device counts the host syncs of object collectives among the step's"),
    "timeline_rank_overlap_inverted": (
        "bench/timeline.py", "{fraction(o, t):.1%} of it under ", "{fraction(t - o, t):.1%} of it under ",
        ["tests/test_timeline.py::test_printed_overlaps_of_every_row_are_the_traces"],
        "bench/timeline.py prints each rank's share of a row not under compute as the share under it"),
    "timeline_all_ranks_of_rank_0": (
        "bench/timeline.py", "        o, t = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())\n"
        "        lines.append(f\"{row} overlapped by compute",
        "        o, t = per[0]\n        lines.append(f\"{row} overlapped by compute",
        ["tests/test_timeline.py::test_printed_overlaps_of_every_row_are_the_traces"],
        "bench/timeline.py's all-ranks overlap is rank 0's"),
    "save_every_without_ckpt_dir": (
        "options.py", "    if args.save_every and not args.ckpt_dir:\n", "    if False:\n",
        ["tests/test_inputs.py::test_checkpoint_options_are_refused_in_one_line"],
        "--save_every without --ckpt_dir accepted (the run saves nothing, silently)"),
    "stop_after_zero_accepted": (
        "options.py", "    if args.stop_after is not None and args.stop_after < 1:\n", "    if False:\n",
        ["tests/test_inputs.py::test_checkpoint_options_are_refused_in_one_line"], "--stop_after 0 accepted"),
    "comm_fp16_average_after_the_sum": (
        "comm.py", "            t.div_(dist.get_world_size())\n            return dist.ReduceOp.SUM\n",
        "            return dist.ReduceOp.SUM\n",
        ["tests/test_fp16.py::test_fp16_parity_and_ledgers[stage2]"],
        "fp16 on gloo sums the ranks' gradients where it should average them first"),
    "comm_all_gather_counted_as_its_input": (
        "comm.py", '        sent = self._count("all_gather", nbytes(out))\n',
        '        sent = self._count("all_gather", nbytes(inp))\n',
        ["tests/test_stages.py::test_communication_bytes_match_formula[stage3-2]"],
        "the ledger counts an all-gather by its input (one rank's shard), not its output"),
    "animate_collectives_as_a_set": (
        "bench/animate.py", "        if issued != timeline:\n", "        if sorted(issued) != sorted(timeline):\n",
        ["tests/test_animate.py::test_the_checks_catch_planted_frames"],
        "the animation's check compares each rank's collectives as a set, not in the order the frames issue them"),
    "animate_end_frames_to_rank0s_ledger": (
        "bench/animate.py", '        ledger = summary["model_state_bytes_per_rank"][r]\n',
        '        ledger = summary["model_state_bytes_per_rank"][0]\n',
        ["tests/test_animate.py::test_the_checks_catch_planted_frames"],
        "every rank's end frame held to rank 0's ledger"),
    "animate_in_flight_not_held": (
        "bench/animate.py", "            held[k] = held.get(k, 0) + n\n", "            held[k] = held.get(k, 0)\n",
        ["tests/test_animate.py::test_a_unit_never_freed_shows_at_the_end"],
        "the animation's bars leave out the units gathered and the buckets in flight"),
    "animate_live_counts_the_data_set": (
        "bench/animate.py", "live=memory - data_bytes,", "live=memory,",
        ["tests/test_animate.py::test_frames_agree_with_the_ledgers[stage3.py]"],
        "the animation's live counts the data set, which the run's memory table leaves out"),
    "animate_no_update_frame": (
        "bench/animate.py", "            if i == done:\n", "            if i == -1:\n",
        ["tests/test_animate.py::test_frames_agree_with_the_ledgers[stage3.py]"],
        "no frame says that the optimizer updated the shard"),
    "offload_copy_down_every_micro_step": (
        "offload.py", "            if self.sync:\n                self.squares[",
        "            if True:\n                self.squares[",
        ["tests/test_offload.py::test_one_copy_down_per_bucket_per_step"],
        "offload copies each micro-step's gradient shard down, not only the last one's sum (the fake device's only)"),
    "bench_nvme_counts_the_step_befores_transfer": (
        "bench/bench_nvme.py", '              and not e["args"].get("submitted_before_the_step")]\n', "              ]\n",
        ["tests/test_nvme.py::test_step_figures_are_the_traced_steps_own"],
        "bench_nvme counts a write the step before left in flight among the traced step's bytes"),
    "bench_nvme_verdict_of_the_unrounded_ratio": (
        "bench/bench_nvme.py", 'ratio_verdict = lambda r: "met" if round(r, 2) <= GOAL_RATIO',
        'ratio_verdict = lambda r: "met" if r <= GOAL_RATIO',
        ["tests/test_nvme.py::test_tier_table_arithmetic"],
        "bench_nvme's verdict says missed beside a ratio printed as the goal itself (1.20 against 1.2)"),
    "bench_readme_nvme_step_time": (
        "bench/README.md", "buffers (136 ms) came out faster", "buffers (163 ms) came out faster",
        ["tests/test_docs.py::test_bench_readme_nvme_tier_sentences_are_its_table"],
        "bench/README.md's sentence on the NVMe tier's step not its table's"),
    "timeline_transfer_from_before_unmarked": (
        "instruments.py", '**({"submitted_before_the_step": True} if a < t0 else {})', "**{}",
        ["tests/test_timeline.py::test_a_transfer_from_the_step_before_says_so"],
        "the timeline draws the step before's NVMe write as the step's own (bench_nvme then counts its bytes)"),
    "stage0_buckets_in_completion_order": (
        "stage0_ddp.py",
        "        while self.sync and self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket]"
        ".waiting:\n            b = self.buckets[self.next_bucket]\n",
        "        if b.waiting == 0 and self.sync:\n",
        ["tests/test_any_model_random.py::test_random_models_match_torch_adamw[stage0_ddp-2]"],
        "stage 0 reduces a bucket the moment it completes: ranks completing them in other orders pair wrong buckets"),
    "stage2_buckets_in_completion_order": (
        "stage2.py",
        "        while self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket].waiting:\n"
        "            b = self.buckets[self.next_bucket]\n",
        "        if b.waiting == 0:\n",
        ["tests/test_any_model_random.py::test_random_models_match_torch_adamw[stage2-2]"],
        "stage 2 reduces a bucket the moment it completes: ranks completing them in other orders pair wrong buckets"),
    "stage3_unit_order_unchecked": (
        "stage3.py", "        self.outside.order.agree()\n", "",
        ["tests/test_any_model_random.py::test_random_models_match_torch_adamw[stage3-2]"],
        "stage 3 never compares the ranks' unit orders: experts run in a data-dependent order train on mixed weights"),
    "outside_views_unguarded": (
        "outside.py", "                        o.__class__ = ParamView\n", "                        pass\n",
        ["tests/test_any_model_random.py::test_random_models_match_torch_adamw[stage3-1]",
         "tests/test_any_model.py::test_a_view_kept_past_its_unit_trains_or_names_its_parameter[stage3]"],
        "a view of a ZeRO-3 parameter kept past its unit's free is a plain tensor: used, it reads freed memory"),
    "checkpoint_0d_view": (
        "checkpoint.py", "t.view(shapes[name]) for name", "t.view(*shapes[name]) for name",
        ["tests/test_any_model.py::test_a_0d_parameter_in_gather_master_and_checkpoints[offload]",
         "tests/test_any_model_random.py::test_random_models_match_torch_adamw[stage1-1]"],
        "gather_master views a 0-d parameter's values with t.view(): a TypeError"),
    "stage1_write_between_steps_undone": (
        "stage1.py", "        require([p._version for p in self.bucket_of] == self.versions, Misuse.WRITTEN)\n", "",
        ["tests/test_any_model.py::test_a_write_between_steps_is_refused_before_the_update[stage1]",
         "tests/test_any_model_random.py::test_random_models_match_torch_adamw[stage1-1]"],
        "stage 1 lets a write to a parameter between steps through: the next update silently undoes it"),
    # serial schedules the modelled clock (tests/fake_clock.py) must see on the fake device's timeline
    "stage0_reduction_waited_in_its_hook": (
        "stage0_ddp.py", "            b.work = comm.all_reduce(b.grad, op=dist.ReduceOp.AVG, async_op=True)\n",
        "            b.work = comm.all_reduce(b.grad, op=dist.ReduceOp.AVG, async_op=True)\n"
        "            b.work.wait()\n",
        ["tests/test_fake_clock.py::test_reductions_under_backward"],
        "each bucket's all-reduce waited for as it is issued: backward stops for every reduction"),
    "stage2_reduction_waited_in_its_hook": (
        "stage2.py",
        "            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)\n",
        "            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)\n"
        "            b.work.wait()\n",
        ["tests/test_fake_clock.py::test_reductions_under_backward"],
        "each bucket's reduce-scatter waited for as it is issued: backward stops for every reduction"),
    "stage3_gathers_after_compute": (
        "stage3.py", "        if after and not self.args.no_prefetch:\n",
        "        if after and self.args.no_prefetch:\n",
        ["tests/test_fake_clock.py::test_stage3_prefetched_gathers_under_compute"],
        "no prefetch: each unit's all-gather issued when it is needed, after the compute before it"),
    "offload_copies_after_backward": (
        "offload.py", "            self._release(b)\n",
        "            torch.autograd.Variable._execution_engine.queue_callback(lambda b=b: (self.copies.stream.wait_stream("
        "torch.cuda.current_stream()), self._release(b)))\n",
        ["tests/test_fake_clock.py::test_offload_gradient_copies_under_backward"],
        "every bucket released (its gradient copied down) at the end of backward, behind all of its kernels"),
    "offload_update_waited_by_the_host": (
        "offload.py",
        "        self.update = self.updater.submit(self._cpu_update, self.spare_grad_shard, landed, lr, coef, scaler)\n",
        "        self.update = self.updater.submit(self._cpu_update, self.spare_grad_shard, landed, lr, coef, scaler)\n"
        "        self.update.exception()\n",
        ["tests/test_fake_clock.py::test_delayed_update_under_forward_and_backward"],
        "--delayed_update's host waits for the update it has just submitted: nothing runs beside it"),
    "timeline_copies_on_the_compute_stream": (
        "instruments.py", '        stream = getattr(copies, "stream", None) if self.cuda else None\n',
        "        stream = torch.cuda.current_stream() if self.cuda else None\n",
        ["tests/test_fake_clock.py::test_copy_spans_are_the_copy_streams"],
        "offload's copy spans timed by events on the compute stream, not on the copy stream that runs them"),
    "timeline_events_without_timing": (
        "instruments.py", "        event = torch.cuda.Event(enable_timing=True)\n",
        "        event = torch.cuda.Event()\n",
        ["tests/test_fake_clock.py::test_copy_spans_are_the_copy_streams"],
        "the timeline's CUDA events made without enable_timing: on a GPU elapsed_time raises"),
    "clock_matmul_rates_swapped": (
        "tests/fake_clock.py",
        '    return 1e12 * RATES["matmul_bfloat16_tflops" if half else "matmul_float32_tflops"]\n',
        '    return 1e12 * RATES["matmul_float32_tflops" if half else "matmul_bfloat16_tflops"]\n',
        ["tests/test_fake_clock.py::test_costs_at_the_h200s_rates"],
        "the modelled clock's matmuls at the other dtype's rate (bf16 at fp32's, fp32 at bf16's)"),
}


def copy_tree(dest):
    """The working tree's files (tracked, and untracked but not ignored) into dest."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def plant(name):
    """Plant slip `name` in a fresh copy; run its tests there. Returns (caught, what caught it or why not, seconds)."""
    file, old, new, tests, _ = SLIPS[name]
    with tempfile.TemporaryDirectory(prefix=f"slip_{name}_") as tmp:
        dest = Path(tmp)
        copy_tree(dest)
        text = (dest / file).read_text(encoding="utf-8")
        if text.count(old) != 1:
            return None, f"out of date: {file} holds the slip's text {text.count(old)} times, not once", 0.0
        (dest / file).write_text(text.replace(old, new), encoding="utf-8")
        t = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["COLUMNS"] = "400"  # pytest cuts its summary lines to the terminal's width
        p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=dest,
                           capture_output=True, text=True, env=env)
        seconds = time.monotonic() - t
        # (a test's id may hold spaces inside its brackets: "test_x[stage3-out of order]")
        failed = re.findall(r"^FAILED ([^\s\[]+(?:\[[^\]]*\])?)(?: - (.*))?$", p.stdout, re.M)
        if p.returncode == 1 and failed:
            test, message = failed[0]
            return True, f"{test}: {(message or '').strip()[:150]}", seconds
        if p.returncode == 0:
            return False, "every claiming test passed", seconds
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        return None, f"pytest exit code {p.returncode}: " + " | ".join(tail), seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="the slips to plant (default: all)")
    parser.add_argument("--list", action="store_true", help="list the slips and the tests that claim them")
    a = parser.parse_args(argv)
    unknown = [n for n in a.names if n not in SLIPS]
    if unknown:
        raise SystemExit(f"error: no slip named {', '.join(unknown)}; --list shows them")
    names = a.names or list(SLIPS)
    if a.list:
        for n in names:
            file, _, _, tests, what = SLIPS[n]
            print(f"{n}: {what} ({file}); claimed by {' '.join(tests)}")
        return 0
    missed = 0
    for n in names:
        caught, detail, seconds = plant(n)
        word = {True: "caught", False: "MISSED", None: "ERROR"}[caught]
        missed += caught is not True
        print(f"{word:7s} {n} ({seconds:.0f} s): {detail}", flush=True)
    print(f"{len(names) - missed} of {len(names)} slips caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
