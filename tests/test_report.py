"`dtnb report --quick` on this machine: all its files, and strategies whose losses agree"
import json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTNB = str(Path(sys.executable).parent / 'dtnb')


def test_report_quick_writes_everything(tmp_path):
    t = time.monotonic()
    r = subprocess.run([DTNB, 'report', '--quick', '--out', str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for f in ('report.md', 'report.html', 'results.json'): assert (tmp_path / f).stat().st_size > 200, f
    res = json.loads((tmp_path / 'results.json').read_text())
    assert res['ok'] is True
    training = res['sections']['Training: every strategy, same losses']['data']
    assert training['agree'] is True and set(training['runs']) == {'single', 'ddp', 'fsdp', 'pipeline'}
    ref = training['runs']['single']['losses']
    for name, run in training['runs'].items():
        assert len(run['losses']) == len(ref) and max(abs(a - b) for a, b in zip(run['losses'], ref)) < 1e-4, name
    assert '<table>' in (tmp_path / 'report.html').read_text()
    for line in (tmp_path / 'report.md').read_text().splitlines():  # every plot the report names exists
        if line.startswith('!['): assert (tmp_path / line.split('(')[1].rstrip(')')).exists(), line
    bench = res['sections']['Benchmarks']['data']
    assert {'matmul', 'memory', 'collectives', 'model', 'scaling'} <= set(bench)
    assert bench['collectives']['rows'] and all(r['wrong'] == 0 for r in bench['collectives']['rows'])
    assert len(list(tmp_path.glob('*.png'))) >= 3
    print(f"dtnb report --quick took {took:.0f}s")


def test_report_bad_model_spec(tmp_path):
    r = subprocess.run([DTNB, 'report', '--quick', '--sections', 'training', '--model', 'nocolon', '--out', str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "use the form module:factory" in r.stdout
