"""`dtnb report` on this machine: its files, a summary that follows its own measurements, your model trained in every
strategy, and the HTML page in a real browser. One quick report is run once and shared by the tests.
The CPU is the subject: the report runs with DTNB_DEVICE=cpu on any machine (`cpu_env`, conftest.py), so its figures
are this CPU's; tools/gpu_check.sh runs `dtnb report --quick` on a GPU machine's GPUs."""
import json, os, subprocess, sys, time
from pathlib import Path
import pytest
from conftest import cpu_env
from test_site import browser, visit  # noqa: F401 (a fixture: headless Chromium, skipped only when told to)

ROOT = Path(__file__).resolve().parent.parent
DTNB = str(Path(sys.executable).parent / 'dtnb')
ENV = cpu_env(None, ROOT / 'tests')  # DTNB_DEVICE=cpu, and the one-GPU stand-in where no GPU is
pytestmark = pytest.mark.usefixtures('cpu_ranks')
TRAINING, PLAN, LOADER = 'Training: every strategy, same losses', 'Which strategy fits', 'Data loader: input-bound?'


def _two_ranks() -> bool:
    "Whether the report runs 2-rank benchmarks here: 2 usable cores (not so under `taskset -c 0`) or accelerators"
    from dtnb.bench.throughput import _ranks
    from dtnb.detection.device import detect
    return _ranks(detect()) >= 2


def dtnb(*args, timeout=600):
    return subprocess.run([DTNB, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.fixture(scope='module')
def quick(tmp_path_factory):
    "One `dtnb report --quick` run: (folder, results.json, CompletedProcess)"
    out = tmp_path_factory.mktemp('report')
    t = time.monotonic()
    r = dtnb('report', '--quick', '--out', out)
    print(f"dtnb report --quick took {time.monotonic() - t:.0f}s")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, json.loads((out / 'results.json').read_text()), r


def test_report_quick_writes_everything(quick):
    out, res, r = quick
    for f in ('report.md', 'report.html', 'results.json'): assert (out / f).stat().st_size > 200, f
    assert res['ok'] is True
    training = res['sections'][TRAINING]['data']
    assert training['agree'] is True
    assert set(training['runs']) == {'single', 'ddp', 'zero1', 'zero2', 'fsdp', 'pipeline'}
    ref = training['runs']['single']['losses']
    for name, run in training['runs'].items():
        assert len(run['losses']) == len(ref) and max(abs(a - b) for a, b in zip(run['losses'], ref)) < 1e-4, name
    md = (out / 'report.md').read_text()
    for line in md.splitlines():  # every plot the report names exists
        if line.startswith('!['): assert (out / line.split('(')[1].rstrip(')')).exists(), line
    assert md.index('## Summary') < md.index('## Machine')
    assert r.stdout.index('== Summary') < r.stdout.index('== Machine')
    loader = res['sections'][LOADER]
    assert loader['error'] is None and loader['data']
    bench = res['sections']['Benchmarks']['data']
    if _two_ranks():
        assert {'matmul', 'memory', 'collectives', 'model', 'scaling'} <= set(bench)
        assert bench['collectives']['rows'] and all(r['wrong'] == 0 for r in bench['collectives']['rows'])
    else: assert {'matmul', 'memory', 'model'} <= set(bench) and not {'collectives', 'scaling'} & set(bench)
    assert len(list(out.glob('*.png'))) >= 3


def test_summary_follows_the_measurements(quick):
    "The strategy, input verdict and number format in the summary are the ones the report's own numbers support"
    _, res, _ = quick
    s, sec = res['summary'], res['sections']
    runs = sec[TRAINING]['data']['runs']
    one = runs['single']['samples_per_s']
    speedup = {k: r['samples_per_s'] / one for k, r in runs.items() if k != 'single'}
    plan = sec[PLAN]['data']['plan']
    single = next(e for e in plan['estimates']
                  if e['strategy'] == 'single' and not e['activation_checkpointing'] and not e['offload'])
    why = ' '.join(s['why'])
    if single['total'] > plan['budget']: assert s['strategy'] == plan['strategy']
    elif max(speedup.values()) >= 1.05: assert s['strategy'] == max(speedup, key=speedup.get)
    else:
        assert s['strategy'] == 'single', s
        assert f"ddp {speedup['ddp']:.2f}×" in why  # the measured speed-up, as measured
        if plan['strategy'] != 'single': assert "overrides the planner's rule of thumb" in why
        bench = sec['Benchmarks']['data']
        if 'collectives' in bench: assert 'all-reduce busbw' in why  # why: sync time vs step time
        if 'scaling' in bench: assert "bench's scaling run" in why
    assert s['input_bound'] == sec[LOADER]['data']['before']['input_bound']
    best = {}
    for r in sec['Benchmarks']['data']['matmul']['rows']: best[r['dtype']] = max(best.get(r['dtype'], 0), r['value'])
    assert s['number_format'] == max(best, key=best.get)
    assert len(s['next_steps']) == 3 and all(code for _, code in s['next_steps']) and s['missing'] == {}


def test_html_report_in_browser(quick, browser, tmp_path):
    "The page alone, copied to another folder (as sent by mail): its plots are inside it"
    out, _, _ = quick
    alone = tmp_path / 'sent' / 'report.html'
    alone.parent.mkdir(); alone.write_bytes((out / 'report.html').read_bytes())
    page, errors, failed = visit(browser, alone.as_uri())
    broken = page.evaluate("[...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
    first = page.evaluate("document.querySelector('section').id")
    homes = page.evaluate("[...document.images].map(i => i.closest('section').id)")
    folded = page.evaluate("[...document.querySelectorAll('#bench details')].map(d => d.open)")
    page.close()
    assert errors == [] and failed == [] and broken == [], (errors, failed, broken)
    assert first == 'summary'
    assert len(homes) >= 3 and set(homes) == {'bench'}  # each plot in its own section, not at the end
    assert folded == [False] * _two_ranks()  # the collective sweep, folded (none with one usable core)


def test_env_html_in_browser(tmp_path, browser):
    r = dtnb('env', '--html', tmp_path / 'env.html', timeout=120)
    assert r.returncode == 0, r.stderr
    page, errors, failed = visit(browser, (tmp_path / 'env.html').as_uri())
    tables = page.evaluate("document.querySelectorAll('section#machine table').length")
    page.close()
    assert errors == [] and failed == [] and tables >= 1


@pytest.mark.long  # a whole-tool run (the quick report trains every strategy already): bash run.sh test-long
def test_report_trains_a_cnn_in_every_strategy(tmp_path):
    "A CNN with BatchNorm from --model and --input-shape: plan, training and loader run on it; exit 0"
    r = dtnb('report', '--quick', '--model', 'models_cnn:cnn', '--input-shape', '3,32,32',
             '--sections', 'env', 'plan', 'training', 'loader', '--out', tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / 'results.json').read_text())
    training = res['sections'][TRAINING]['data']
    assert training['batchnorm'] is True and training['agree'] is None  # differences by design, not an error
    for name, run in training['runs'].items(): assert len(run['losses']) == 8, (name, run)
    assert 'random integer labels' in training['description'] and 'cross_entropy' in training['description']
    assert 'expected, BatchNorm statistics are per rank' in (tmp_path / 'report.md').read_text()
    assert 'traced from a batch of 16' in res['sections'][PLAN]['data']['assumptions']
    assert res['sections'][LOADER]['data']['source'].startswith('samples shaped like your inputs')
    assert res['summary']['missing'] == {'bench': 'not run'}


@pytest.mark.long  # a whole-tool run: bash run.sh test-long
def test_report_batch_factory(tmp_path):
    r = dtnb('report', '--quick', '--model', 'models_cnn:cnn', '--batch', 'models_cnn:make_batch',
             '--sections', 'plan', '--out', tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plan = json.loads((tmp_path / 'results.json').read_text())['sections'][PLAN]['data']
    assert 'the batch from models_cnn:make_batch' in plan['model'] and 'traced from a batch' in plan['assumptions']


def test_report_bad_specs(tmp_path):
    r = dtnb('report', '--quick', '--sections', 'training', '--model', 'nocolon', '--input-shape', '16', '--out',
             tmp_path)
    assert r.returncode == 1 and "use the form module:factory" in r.stdout
    r = dtnb('report', '--model', 'models_cnn:cnn', '--sections', 'training', '--out', tmp_path)
    assert r.returncode == 2 and '--model needs data to train' in r.stderr


def test_plan_memory_with_units():
    r = dtnb('plan', '--params', '7e9', '--world-size', '8', '--memory', '80GB', timeout=120)
    assert r.returncode == 0 and '72 GB per device' in r.stdout, r.stdout + r.stderr
    r = dtnb('plan', '--params', '7e9', '--memory', 'lots', timeout=120)
    assert r.returncode == 2 and "argument --memory: Cannot read a size from 'lots'" in r.stderr, r.stderr
