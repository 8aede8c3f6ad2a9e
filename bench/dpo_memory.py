"""Host resident memory of a DPO run through FuyouDPOTrainer with its reference model streamed
from the SSD array, against the same run with the reference in memory (TRL's own).

    python bench/dpo_memory.py [--json PATH] [--layers 12] [--width 1024] [--steps 4] [--rounds 2]

A GPT-2-shaped model (fp32, vocabulary 1000: its blocks hold nearly all of it) is saved as a
from_pretrained directory with a tokenizer trained here; each case runs in a process of its
own, the cases in interleaved rounds (order rotated), each with a private fuyoud. The policy
is built on the meta device in both and attached with ``fuyou={"weights": DIR}`` (streamed
in one layer group at a time, never whole in memory; its blocks offloaded); the reference:

* ``streamed``: ``FuyouDPOTrainer``'s default: built on the meta device from the same
  directory and attached frozen, its blocks stored once on the SSD array and fetched per
  forward (integrations/trl.py);
* ``in_memory``: ``from_pretrained(DIR)`` passed as ``ref_model`` with
  ``stream_reference=False``: whole in memory, as TRL holds it without Fuyou.
 Reported per case, the
median over rounds of the training process's peak resident memory (VmHWM) over the training
steps after the first (``client_peak_rss``: what the run holds while it trains) and from the
trainer's construction to the end of the first step (``client_peak_rss_to_first_step``), the
daemon's peak over the steps (the shared buffers both processes map count in both), and the
reference's blocks' bytes, which the difference should be near (less the streamed
reference's own weight slots: a few blocks).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import host_info  # noqa: E402

CASES = ("streamed", "in_memory")

WORKER = """
import json, os, sys
import datasets, tokenizers, torch, transformers, trl
import fuyou_client
from fuyou_client.integrations.trl import FuyouDPOTrainer
case, layers, width, steps, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
lines = [l for l in open(sys.argv[6]).read().splitlines() if l.strip()]
base = os.path.join(work, "base")
if not os.path.isdir(base):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(vocab_size=1000, show_progress=False,
        special_tokens=["<unk>", "<eos>", "<pad>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tk = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                              unk_token="<unk>")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=16, vocab_size=len(tk),
        n_positions=128, bos_token_id=1, eos_token_id=1, pad_token_id=2)).save_pretrained(base)
    tk.save_pretrained(base)
def status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
daemon = fuyou_client.start_daemon(config={"storage": {"capacity_per_device": "auto"}})  # (temporary: it goes)
config = transformers.AutoConfig.from_pretrained(base)
with torch.device("meta"):  # (the policy: attach streams its weights in, one layer group at a time)
    model = transformers.AutoModelForCausalLM.from_config(config)
tk = transformers.AutoTokenizer.from_pretrained(base)
blocks = sum(p.numel() * p.element_size() for p in model.transformer.h.parameters())
data = datasets.Dataset.from_dict({"prompt": lines[:16], "chosen": lines[16:32], "rejected": lines[32:48]})
args = trl.DPOConfig(output_dir=os.path.join(work, "out-" + case), max_steps=steps, per_device_train_batch_size=1,
                     max_length=64, learning_rate=1e-5, optim="adamw_torch_fused", report_to="none", use_cpu=True,
                     save_strategy="no", logging_steps=1, disable_tqdm=True, bf16=False)
def reset_peaks():
    for pid in ("self", daemon.pid):
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
peaks = {}
class Steady(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 1:  # (the first step done: the peaks of the steps after it, from here)
            peaks["construction"] = status("self", "VmHWM")
            reset_peaks()
reset_peaks()  # (VmHWM from here: the trainer's construction and the training)
start = status("self", "VmRSS")
reference = {} if case == "streamed" else {  # (TRL's own: loaded from the directory, whole in memory)
    "ref_model": transformers.AutoModelForCausalLM.from_pretrained(base), "stream_reference": False}
trainer = FuyouDPOTrainer(model=model, args=args, train_dataset=data, processing_class=tk, callbacks=[Steady()],
                          fuyou={"socket": daemon.socket, "weights": base}, **reference)
trainer.train()
result = {"reference_block_bytes": blocks, "client_rss_at_start": start,
          "client_peak_rss_to_first_step": peaks["construction"], "client_peak_rss": status("self", "VmHWM"),
          "daemon_peak_rss": status(daemon.pid, "VmHWM"),
          "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}
trainer.close()
daemon.stop()
print(json.dumps(result))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory(prefix="fy-dpo-mem-", dir=args.dir) as work:
        for r in range(args.rounds):
            for case in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
                out = subprocess.run([sys.executable, "-c", WORKER, case, str(args.layers), str(args.width),
                                      str(args.steps), work, str(ROOT / "examples" / "data" / "corpus.txt")],
                                     capture_output=True, text=True, timeout=3600)
                if out.returncode != 0:
                    raise SystemExit(f"{case} failed:\n{out.stderr[-3000:]}")
                runs[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
                run = runs[case][-1]
                print(f"round {r} {case}: client peak over the steps {run['client_peak_rss'] / 2**20:.0f} MiB (to "
                      f"the first step {run['client_peak_rss_to_first_step'] / 2**20:.0f}), daemon "
                      f"{run['daemon_peak_rss'] / 2**20:.0f} MiB", flush=True)
        host = host_info(Path(work))
    med = {c: {k: statistics.median(run[k] for run in runs[c])
               for k in ("client_peak_rss", "client_peak_rss_to_first_step", "daemon_peak_rss",
                       "client_rss_at_start")} for c in CASES}
    ref_bytes = runs[CASES[0]][0]["reference_block_bytes"]
    saved = med["in_memory"]["client_peak_rss"] - med["streamed"]["client_peak_rss"]
    for c in CASES:
        print(f"{c}: peak from construction to the first step {med[c]['client_peak_rss_to_first_step'] / 2**30:.2f} "
              "GiB")
    result = {
        "command": "python " + " ".join(["bench/dpo_memory.py", *(argv if argv is not None else sys.argv[1:])]),
        "host": host, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "layers": args.layers, "width": args.width, "steps": args.steps, "rounds": args.rounds,
        "reference_block_bytes": ref_bytes, "runs": runs, "medians": med,
        "client_peak_gib": {c: med[c]["client_peak_rss"] / 2**30 for c in CASES},
        "client_peak_to_first_step_gib": {c: med[c]["client_peak_rss_to_first_step"] / 2**30 for c in CASES},
        "daemon_peak_gib": {c: med[c]["daemon_peak_rss"] / 2**30 for c in CASES},
        "client_peak_saved_gib": saved / 2**30,
        "saved_over_reference_blocks": saved / ref_bytes,
        "same_losses": all(a["losses"] == b["losses"] for a, b in zip(runs["streamed"], runs["in_memory"])),
    }
    print(f"reference blocks {ref_bytes / 2**30:.2f} GiB; client peak over the steps: streamed "
          f"{result['client_peak_gib']['streamed']:.2f} GiB, in memory {result['client_peak_gib']['in_memory']:.2f} "
          f"GiB (saved {saved / 2**30:.2f} GiB, {result['saved_over_reference_blocks']:.2f}x the reference's blocks); "
          f"daemon peak: {result['daemon_peak_gib']['streamed']:.2f} / {result['daemon_peak_gib']['in_memory']:.2f} "
          f"GiB; same losses: {result['same_losses']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
