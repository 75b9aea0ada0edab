"""Run only the GPU cells of the notebooks: each `#| cuda` cell (and `#| multicuda` with --multi) with the cells it
needs, and nothing else; the CPU cells are CI's. tools/gpu_check.sh runs it on a GPU machine.

A notebook's GPU cells use names its earlier cells define (a helper, a model, a CPU reference). So each notebook runs
a slice of itself: its export cells (the module's code), its import cells, cells that set `os.environ` (the CPU pin
that the GPU cells lift with `placement(None)`), the GPU cells, and, walking back from those, every earlier cell
that assigns a name a kept cell reads. Cells carrying a skip flag (`notest`, `slow`, ...) stay out unless they are
the GPU cells. On a GPU each notebook runs in its own process (a CUDA context or a memory fraction set by one never
reaches the next).

    python tools/cuda_cells.py [--multi] [--dry-run] [--out FILE.json] [NOTEBOOK ...]   default: every notebook
                                                                                       with a GPU cell

--dry-run runs the same slices with the GPU cells left out (a CPU machine: their supporting cells must run, the GPU
cells must compile, and every name they read must be defined once the slice ran), the notebooks pinned to the CPU
under the one-GPU stand-in of tests/standin, in two processes (pinned, others), so CI proves the slices are
complete. Exit 1 when a notebook failed.
"""
import argparse, ast, builtins, json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEEP_DIRECTIVES = ('export', 'exports', 'exporti')
SKIP_FLAGS = ('notest', 'slow', 'cuda', 'multicuda')


def directives(src: str) -> set:
    "The `#| name ...` directives of a cell, by name"
    return {l[3:].split()[0] for l in src.splitlines() if l.startswith('#| ') and l[3:].split()}


def names(src: str) -> tuple[set, set]:
    "(names the cell assigns, names it reads before or without assigning them); empty sets if it does not parse"
    code = '\n'.join(l for l in src.splitlines() if not l.lstrip().startswith(('%', '!')))
    try: tree = ast.parse(code)
    except SyntaxError: return set(), set()
    stores, loads = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name): (loads if isinstance(n.ctx, ast.Load) else stores).add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): stores.add(n.name)
        elif isinstance(n, ast.alias): stores.add((n.asname or n.name).split('.')[0])
        elif isinstance(n, ast.arg): stores.add(n.arg)
    return stores, loads - stores - set(dir(builtins))


def is_import_cell(src: str) -> bool:
    try: body = ast.parse('\n'.join(l for l in src.splitlines() if not l.startswith('#|'))).body
    except SyntaxError: return False
    return bool(body) and all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body)


def gpu_cells(cells, multi=False) -> list[int]:
    "Indexes of the code cells to run as GPU cells"
    want = {'cuda', 'multicuda'} if multi else {'cuda'}
    return [i for i, c in enumerate(cells) if c['cell_type'] == 'code' and directives(c['source']) & want]


def plan(cells, multi=False) -> list[int]:
    "Indexes of the cells to run for the GPU cells of a notebook: the slice described above, in notebook order"
    gpu = set(gpu_cells(cells, multi))
    if not gpu: return []
    keep, needed = set(gpu), set()
    for i, c in enumerate(cells):
        if c['cell_type'] != 'code' or i in gpu: continue
        d, src = directives(c['source']), c['source']
        if d & set(SKIP_FLAGS) or 'eval: false' in src: continue
        if d & set(KEEP_DIRECTIVES) or is_import_cell(src) or 'os.environ[' in src: keep.add(i)
    last = max(gpu)
    for i in range(last, -1, -1):  # walking back: an earlier cell that assigns a name a kept cell reads is needed
        c = cells[i]
        if c['cell_type'] != 'code': continue
        d = directives(c['source'])
        if i not in keep and (d & set(SKIP_FLAGS) or 'eval: false' in c['source']): continue
        stores, loads = names(c['source'])
        if i in keep or stores & needed:
            keep.add(i); needed |= loads
    return sorted(i for i in keep if i <= last)


def notebooks_with_gpu_cells(multi=False):
    nbs = sorted((ROOT / 'nbs').glob('*.ipynb')) + sorted((ROOT / 'nbs').glob('*/*.ipynb'))
    return [p for p in nbs if gpu_cells(_cells(p), multi)]


def _cells(path):
    "The notebook's cells with each source as one string"
    cells = json.loads(Path(path).read_text())['cells']
    return [dict(c, source=''.join(c['source']) if isinstance(c['source'], list) else c['source']) for c in cells]


PIN = "os.environ['DTNB_DEVICE'] = 'cpu'"


def pinned(path) -> bool:
    "Whether the notebook pins dtnb to the CPU (its GPU cells lift the pin with `placement(None)`)"
    return any(PIN in c['source'] for c in _cells(path))


def run_one(path, multi, dry):
    "In this process: run the slice of notebook `path` (GPU cells left out under `dry`); raise on a failed cell"
    from execnb.shell import CaptureShell
    from fastcore.xtras import working_directory
    from nbdev.process import NBProcessor
    cells = _cells(path)
    keep, gpu = plan(cells, multi), set(gpu_cells(cells, multi))
    for i in gpu: compile('\n'.join(l for l in cells[i]['source'].splitlines()
                                    if not l.lstrip().startswith(('%', '!'))), f'{path}:cell{i}', 'exec')
    run = {i for i in keep if not (dry and i in gpu)}
    nb = NBProcessor(path, rm_directives=False, process=True).nb
    assert len(nb.cells) == len(cells), f"{path}: nbdev's processing changed the number of cells"
    for i, c in enumerate(nb.cells): c['_gpu_check_index'] = i
    before, shell = os.environ.get('DTNB_DEVICE'), CaptureShell(path)
    try:
        with working_directory(Path(path).parent):
            shell.run_all(nb, exc_stop=True, preproc=lambda c: c['_gpu_check_index'] not in run, cell_timeout=None)
    finally:  # a notebook's pin stays with it
        if before is None: os.environ.pop('DTNB_DEVICE', None)
        else: os.environ['DTNB_DEVICE'] = before
    if dry:  # the slice is complete: every name a GPU cell reads is defined once its supporting cells have run
        given = {n for i in gpu for n in names(cells[i]['source'])[0]}  # by another GPU cell, when they run
        missing = sorted({n for i in gpu for n in names(cells[i]['source'])[1]} - set(shell.user_ns) - given)
        if missing:
            raise NameError(f"{Path(path).name}: its GPU cells read {missing}, which the slice leaves undefined")
    print(f"{Path(path).name}: ran {len(run)} of {len(cells)} cells ({len(gpu)} GPU cell(s)"
          f"{', left out: dry run' if dry else ''})")


def run_many(paths, multi, dry):
    "In this process, one notebook after another; a line `RESULT {json}` after each"
    import traceback
    os.environ['IN_TEST'] = '1'
    sys.path.insert(0, str(ROOT))
    for p in paths:
        t0, ok = time.time(), True
        try: run_one(p, multi, dry)
        except Exception:
            traceback.print_exc(); ok = False
        print('RESULT ' + json.dumps(dict(notebook=Path(p).name, seconds=round(time.time() - t0, 1), passed=ok)),
              flush=True)


def groups(paths, dry):
    """Processes to run the notebooks in: on a GPU one each (a CUDA context, a memory fraction, a pin stays with its
    notebook); in a dry run two, the pinned notebooks under the one-GPU stand-in (tests/standin) and the others"""
    if not dry: return [([p], {}) for p in paths]
    standin = {'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT / 'tests' / 'standin'),
                                                             os.environ.get('PYTHONPATH')])),
               'DTNB_STANDIN_GPUS': '1'}
    pin = [p for p in paths if pinned(p)]
    return [g for g in ((pin, standin), ([p for p in paths if p not in pin], {})) if g[0]]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('notebooks', nargs='*')
    ap.add_argument('--multi', action='store_true', help='#| multicuda cells too (two GPUs or more)')
    ap.add_argument('--dry-run', action='store_true', help='the slices without their GPU cells (a CPU machine)')
    ap.add_argument('--out', help='JSON file: per notebook, the cells run, seconds, passed')
    ap.add_argument('--in-process', nargs='+', help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.in_process: return run_many(a.in_process, a.multi, a.dry_run)
    nbs = [Path(p).resolve() for p in a.notebooks] or notebooks_with_gpu_cells(a.multi)
    results, failed = [], False
    for paths, env in groups(nbs, a.dry_run):
        cmd = [sys.executable, __file__, '--in-process', *map(str, paths)] + ['--multi'] * a.multi + \
              ['--dry-run'] * a.dry_run
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
        done = set()
        for line in proc.stdout:
            print(line, end='', flush=True)
            if not line.startswith('RESULT '): continue
            res = json.loads(line[7:]); p = next(q for q in paths if q.name == res['notebook']); done.add(p)
            cells = _cells(p)
            res.update(cells=len(cells), ran=len(plan(cells, a.multi)) - (len(gpu_cells(cells, a.multi)) if
                       a.dry_run else 0), gpu_cells=len(gpu_cells(cells, a.multi)), gpu_cells_ran=not a.dry_run,
                       standin=bool(env))
            results.append(res); failed |= not res['passed']
            if a.out: Path(a.out).write_text(json.dumps(results, indent=1))  # as soon as each one is known
        if proc.wait() != 0 or len(done) < len(paths):
            failed = True
            results += [dict(notebook=p.name, passed=False, note=f'its process ended with {proc.returncode}')
                        for p in paths if p not in done]
            if a.out: Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"cuda_cells: {sum(r['passed'] for r in results)} of {len(results)} notebooks passed")
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
