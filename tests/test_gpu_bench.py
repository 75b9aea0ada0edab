"""benchmarks/gpu_bench.py off a GPU: its comparison logic on the CPU, its no-CUDA path, and the `#| cuda` cells of the
bench notebooks, which nothing runs here, checked to compile and to use only names their notebook defines"""
import ast, builtins, importlib, importlib.util, json, os, subprocess, sys
from pathlib import Path
import pytest, torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'benchmarks' / 'gpu_bench.py'
GPU_NBS = ('07_bench.compute', '07b_bench.throughput')


def _script():
    spec = importlib.util.spec_from_file_location('gpu_bench', SCRIPT)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


@pytest.mark.long  # a whole-tool run: bash run.sh test-long
def test_cpu_path_runs_every_comparison(tmp_path):
    "`--device cpu --quick`: every section runs dtnb's benchmark beside the plain loop; the JSON holds both sides"
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])}
    r = subprocess.run([sys.executable, str(SCRIPT), '--device', 'cpu', '--quick', '--out', str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'no GPU figure' in r.stdout and '== anchors' in r.stdout
    d = json.loads((tmp_path / 'gpu_bench.json').read_text())
    assert d['gpu_figures'] is False and d['measured_on'] == 'cpu' and d['failed_sections'] == [] and d['complete']
    assert d['fingerprint']['torch'] == torch.__version__ and d['fingerprint']['dtnb']
    s = d['sections']
    assert list(s) == ['matmul', 'memory', 'mfu', 'step']
    assert {a['verdict'] for x in s.values() for a in x['anchors']} == {'cpu n/a'}  # no anchor is held on a CPU
    for name, m in s['matmul']['summary'].items():   # the ratio is dtnb's max over the plain loop's max
        assert m['dtnb_max_tflops'] > 0 and m['plain_max_tflops'] > 0 and m['spec_peak_tflops'] == 'unknown'
        assert abs(m['ratio'] - m['dtnb_max_tflops'] / m['plain_max_tflops']) < 1e-12
        assert m['dtnb_max_tflops'] == max(x['dtnb_tflops'] for x in s['matmul']['rows'] if x['dtype'] == name)
    mem = s['memory']['summary']
    assert mem['copy_dtnb_gbs'] > 0 and mem['copy_plain_gbs'] > 0 and mem['spec_gbs'] == 'unknown'
    g, mfu = d['config']['gpt'], s['mfu']['summary']   # FlopCounterMode counts what the formula says, exactly
    assert mfu['flops_counted'] == g['L'] * (72 * g['b'] * g['s'] * g['h']**2 + 12 * g['b'] * g['s']**2 * g['h'])
    assert mfu['measured_matmul_peak_tflops'] == s['matmul']['summary']['fp32']['dtnb_max_tflops']
    assert 0 < mfu['dtnb_mfu_vs_measured'] and mfu['dtnb_mfu_vs_spec'] == 'unknown'
    for strategy in ('ddp', 'fsdp'):   # wrap(model, strategy) trains exactly as DDP / fully_shard written by hand
        st = s['step']['summary'][strategy]
        assert len(st['dtnb_losses']) >= 4 and st['dtnb_losses'] == st['torch_losses'], st
        assert st['ratio'] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the script measures instead")
def test_no_cuda_path_says_so_and_writes_nothing(tmp_path, capsys):
    mod = _script()
    assert mod.main(['--out', str(tmp_path / 'out')]) == 0
    assert 'no CUDA device here' in capsys.readouterr().out
    assert not (tmp_path / 'out').exists()
    with pytest.raises(SystemExit): mod.main(['--device', 'cpu', '--only', 'matmul,flops'])  # unknown section


def test_anchors_and_fingerprint_of_an_h100(tmp_path, monkeypatch):
    "The figures an H100 SXM is held to, and the driver read from a recorded nvidia-smi (a stand-in for the query)"
    mod = _script()
    h100 = mod.peaks_of('NVIDIA H100 80GB HBM3', 'bf16')
    assert h100[:2] == (989.4, 794.0) and 'issue 15' in h100[2]
    assert mod.peaks_of('NVIDIA H100 80GB HBM3', 'fp32')[1] is None       # no known max: 'unknown', never borrowed
    assert mod.peaks_of('NVIDIA A100-SXM4-80GB', 'bf16') == (312.0, None, None)
    smi = tmp_path / 'nvidia-smi'
    smi.write_text('#!/bin/sh\necho "0, NVIDIA H100 80GB HBM3, 550.54.15, 00000000:18:00.0, 1980 MHz, 700.00 W"\n')
    smi.chmod(0o755); monkeypatch.setenv('PATH', f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert mod.nvidia_smi('index,name') == ['0, NVIDIA H100 80GB HBM3, 550.54.15, 00000000:18:00.0, 1980 MHz, 700.00 W']
    smi.write_text('#!/bin/sh\necho "Field power.limit is not a valid field"; exit 2\n')
    assert mod.nvidia_smi('power.limit') is None                              # a failing nvidia-smi is no fingerprint


def _cells(nb):
    cells = json.loads((ROOT / 'nbs' / f'{nb}.ipynb').read_text())['cells']
    return [''.join(c['source']) for c in cells if c['cell_type'] == 'code']


def _bound(tree):
    "Names a piece of code binds: assignments, defs, arguments, imports"
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)): out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): out.add(n.name)
        elif isinstance(n, ast.arg): out.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                if a.name == '*': out |= {k for k in dir(importlib.import_module(n.module)) if not k.startswith('_')}
                else: out.add((a.asname or a.name).split('.')[0])
        elif isinstance(n, ast.ExceptHandler) and n.name: out.add(n.name)
    return out


@pytest.mark.parametrize('nb', GPU_NBS)
def test_gpu_cells_compile_and_use_defined_names(nb):
    "The `#| cuda` / `#| multicuda` cells parse, import nothing (docs builds run cells that import), name no unknown"
    src = _cells(nb)
    gpu = [c for c in src if c.lstrip().startswith(('#| cuda', '#| multicuda'))]
    assert len(gpu) >= 3, f"{nb}: expected the GPU anchor cells, found {len(gpu)}"
    defined = set(dir(builtins)) | set().union(*(_bound(ast.parse(c)) for c in src if not c.lstrip().startswith('%')))
    for c in gpu:
        tree = compile(c, f'{nb} cuda cell', 'exec', ast.PyCF_ONLY_AST)
        assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)), c
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert not (unknown := used - defined), f"{nb}: {sorted(unknown)} undefined in\n{c}"
