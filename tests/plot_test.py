"""scripts/plot as a user runs it (CTest: plot_script), on two small synthetic runs: the exit
status, the PNG written (a PNG's signature, more than a header's bytes, the size asked for),
and the message for each kind of bad metrics.jsonl, naming the file and the line.

    python tests/plot_test.py SCRIPTS_PLOT
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

PLOT = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "plot"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_plot(*args, cwd=None):
    r = subprocess.run([PLOT, *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    return r.returncode, r.stdout + r.stderr


def write_run(folder, steps, loss0, peak, resumed_at=None):
    """A run folder with a metrics.jsonl as spmdx writes it: `steps` rows, a loss falling from
    loss0; with resumed_at, the history of a run resumed from that step appended after it."""
    os.makedirs(folder, exist_ok=True)
    rows = []
    for s in range(1, steps + 1):
        rows.append({"step": s, "loss": loss0 / (1 + 0.1 * s), "grad_norm": 2.0 / s, "lr": 8e-4 * min(1, s / 5), "tokens_per_s": 4000 + 10 * s,
                     "step_ms": 120.0, "peak_mem_bytes": peak, "planned_peak_mem_bytes": peak - 1000, "rss_bytes": 3 * peak})
    rows[-1]["val_loss"] = rows[-1]["loss"] + 0.1
    rows[2]["loss"] = None  # a NaN loss is written as null
    if resumed_at:
        rows += [{"step": s, "loss": loss0 / (1 + 0.1 * s), "grad_norm": 1.0, "lr": 4e-4, "tokens_per_s": 3900, "peak_mem_bytes": peak}
                 for s in range(resumed_at, steps + 3)]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


class Plot(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def assert_png(self, path):
        self.assertTrue(os.path.isfile(path), path)
        with open(path, "rb") as f:
            data = f.read()
        self.assertEqual(data[:8], PNG_SIGNATURE)
        self.assertGreater(len(data), 10000)  # a drawing, not a header
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR
        self.assertEqual((width, height), (1100, 1000))  # figsize 11 x 10 at 100 dpi

    def test_two_runs_are_drawn_into_one_png(self):
        write_run(os.path.join(self.dir, "fsdp"), 12, 6.0, 50 << 20)
        write_run(os.path.join(self.dir, "ddp"), 10, 5.8, 70 << 20, resumed_at=6)
        out = os.path.join(self.dir, "both.png")
        code, text = run_plot(os.path.join(self.dir, "fsdp"), os.path.join(self.dir, "ddp", "metrics.jsonl"), "-o", out)
        self.assertEqual(code, 0, text)
        self.assertIn(f"wrote {out} (2 runs: fsdp, ddp)", text)
        self.assert_png(out)
        # The default output: metrics.png in the current folder.
        code, text = run_plot("fsdp", cwd=self.dir)
        self.assertEqual(code, 0, text)
        self.assert_png(os.path.join(self.dir, "metrics.png"))

    def test_runs_in_folders_of_one_name_are_told_apart(self):
        for parent in ("a", "b"):
            write_run(os.path.join(self.dir, parent, "run"), 4, 6.0, 1 << 30)
        code, text = run_plot(os.path.join(self.dir, "a", "run"), os.path.join(self.dir, "b", "run"), "-o", os.path.join(self.dir, "x.png"))
        self.assertEqual(code, 0, text)
        self.assertIn("(2 runs: a/run, b/run)", text)

    def test_bad_metrics_are_named_with_file_and_line(self):
        good = os.path.join(self.dir, "good")
        write_run(good, 5, 6.0, 1 << 20)
        out = os.path.join(self.dir, "out.png")

        def fails(content, *expected, name="bad"):
            folder = os.path.join(self.dir, name)
            os.makedirs(folder, exist_ok=True)
            if content is not None:
                with open(os.path.join(folder, "metrics.jsonl"), "wb") as f:
                    f.write(content.encode() if isinstance(content, str) else content)
            code, text = run_plot(good, folder, "-o", out)
            self.assertEqual(code, 1, text)
            for e in expected:
                self.assertIn(e, text)
            self.assertNotIn("Traceback", text)
            self.assertFalse(os.path.exists(out), "nothing written")
            return text

        path = os.path.join(self.dir, "bad", "metrics.jsonl")
        fails(None, f"plot: {os.path.join(self.dir, 'missing', 'metrics.jsonl')}: no such file: is {os.path.join(self.dir, 'missing')} a run's folder", name="missing")
        fails("", f"plot: {path}: empty: no step's row in it")
        fails("\n\n", f"plot: {path}: empty")
        row = json.dumps({"step": 1, "loss": 5.0})
        fails(row + "\n" + '{"step": 2, "loss": 4.9' + "\n", f"plot: {path}:2: not a JSON row (Expecting ',' delimiter at column 24): {{\"step\": 2, \"loss\": 4.9")
        fails(row + "\n[1, 2]\n", f"plot: {path}:2: a row is a JSON object, not [1, 2]")
        fails(row + "\n" + json.dumps({"step": "3", "loss": 4.0}) + "\n", f"plot: {path}:2: \"step\" is \"3\", not a whole number")
        fails(json.dumps({"step": 1, "loss": "low"}) + "\n", f"plot: {path}:1: \"loss\" is \"low\", not a number")
        fails(json.dumps({"loss": 4.0}) + "\n", f"plot: {path}:1: the row has metrics but no \"step\"")
        fails(b'{"step": 1}\n\xff\xfe\n', f"plot: {path}:2: not UTF-8 text")
        code, text = run_plot(os.path.join(self.dir, "nowhere"), "-o", out)
        self.assertEqual(code, 1, text)
        self.assertIn(f"plot: {os.path.join(self.dir, 'nowhere')}: no such file or folder: give a run's folder", text)

    def test_a_marker_row_between_runs_is_passed_over(self):
        folder = os.path.join(self.dir, "marked")
        write_run(folder, 4, 6.0, 1 << 20)
        with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"event": "resumed", "from_step": 2}) + "\n" + json.dumps({"step": 3, "loss": 4.0}) + "\n")
        code, text = run_plot(folder, "-o", os.path.join(self.dir, "m.png"))
        self.assertEqual(code, 0, text)
        self.assert_png(os.path.join(self.dir, "m.png"))

    def test_usage_errors(self):
        code, text = run_plot()
        self.assertEqual(code, 2)
        self.assertIn("usage: scripts/plot", text)
        write_run(os.path.join(self.dir, "r"), 3, 6.0, 1 << 20)
        code, text = run_plot(os.path.join(self.dir, "r"), "-o", os.path.join(self.dir, "out.svg"))
        self.assertEqual(code, 2)
        self.assertIn("give a .png file", text)
        code, text = run_plot(os.path.join(self.dir, "r"), "-o", os.path.join(self.dir, "no", "out.png"))
        self.assertEqual(code, 1)
        self.assertIn("no folder", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
