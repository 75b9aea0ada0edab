"""`launch` forks only when fork is safe (`fork_hazards`), on every torch build.

Each case runs in a fresh interpreter, so that what this pytest process ran before does not decide the outcome.
The autograd case is the one of the CUDA builds of torch (the `pip install torch` default, also on a machine without
a GPU): `torch.export` and one `backward()` in the parent start autograd's device threads, and forked ranks then die
at their first backward. On the CPU build the same parent starts none and `launch` forks; on the CUDA build it must
start the ranks from its fork server, say why, and train the same. CI runs this file on both builds (`.ci/run`). The
training function is defined in the script's `__main__`, as in a notebook: under forkserver and spawn it travels by
value (cloudpickle).
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_env`, conftest.py)."""
import json, subprocess, sys, textwrap
import pytest
from conftest import cpu_env, ROOT

pytestmark = pytest.mark.usefixtures('cpu_ranks')

HEAD = """
import json, os, sys, warnings
import torch, dtnb
fork_hazards = dtnb.fork_hazards
torch.set_num_threads(1)

def train(strategy):
    torch.manual_seed(0)
    model = dtnb.wrap(dtnb.ToyModel(), strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = dtnb.distributed_loader(dtnb.toy_data(64), global_batch_size=16, shuffle=False)
    return dtnb.fit(model, loader, opt, max_steps=4, progress=False).losses

def launch(*args, **kw):
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        res = dtnb.launch(*args, **kw)
    return res, [str(w.message) for w in ws if 'starts the ranks with' in str(w.message)]
"""


def _run(body, timeout=240):
    "Run HEAD + `body` in a fresh interpreter (guarded, as spawn needs); return the JSON it printed last"
    src = HEAD + "\nif __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(body), '    ')
    r = subprocess.run([sys.executable, '-c', src], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=cpu_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_autograd_threads_after_export_and_backward_launch_still_trains():
    out = _run("""
        torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
        torch.nn.Linear(2, 2)(torch.zeros(1, 2)).sum().backward()
        hazards = fork_hazards()
        one = train('single')
        (two, _), says = launch(train, 'ddp', nprocs=2)
        parents = [launch(os.getppid, nprocs=2)[0] for _ in range(2)]
        try: dtnb.launch(train, 'ddp', nprocs=2, start_method='fork'); forced = 'ran'
        except RuntimeError as e: forced = str(e)
        print(json.dumps(dict(hazards=hazards, one=one, two=two, says=says, forced=forced, parents=parents,
                              me=os.getpid(), torch=torch.__version__)))
    """)
    assert out['two'] == pytest.approx(out['one'], abs=1e-5), out   # DDP on 2 ranks = one process
    autograd = [h for h in out['hazards'] if h.startswith("autograd's device threads run")]
    if autograd:   # the CUDA builds: from the fork server, said why in one line, and fork refused with the remedy
        # the thread count in the reason grows as the parent trains (6 before `train('single')`, 8 after): not compared
        assert len(out['says']) == 1 and "forkserver, not fork" in out['says'][0], out
        assert "autograd's device threads run (" in out['says'][0], out
        assert "start_method=None" in out['forced'] and "'forkserver'" in out['forced'], out
        # every rank of every launch is forked by one server (started once, torch imported there), not by this process
        (a0, a1), (b0, b1) = out['parents']
        assert a0 == a1 == b0 == b1 != out['me'], out
    else:          # the CPU build: nothing to avoid, so the ranks were forked without a word
        assert out['says'] == [] and out['forced'] == 'ran', out
        assert all(p == out['me'] for ps in out['parents'] for p in ps), out


@pytest.mark.long  # a second fork-safety cause, 20 s: bash run.sh test-long
def test_a_store_server_thread_makes_launch_use_the_fork_server_and_say_why():
    out = _run("""
        import torch.distributed as dist
        clean = fork_hazards()
        store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)
        hazards = fork_hazards()
        (two, _), says = launch(train, 'ddp', nprocs=2)
        import linecache   # a notebook cell: code with no file, a cached helper, a rank that fails in it
        name, cell = '<ipython-input-7-0123abcd>', CELL
        linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
        ns = dict(__name__='__main__'); exec(compile(cell, name, 'exec'), ns)
        try: dtnb.launch(ns['cell_fn'], nprocs=1); failed = ''
        except Exception as e: failed = str(e)
        print(json.dumps(dict(clean=clean, hazards=hazards, two=two, one=train('single'), says=says, failed=failed)))
    """.replace('CELL', repr(CELL)))
    assert out['clean'] == [], out   # a fresh interpreter with torch imported: fork is safe
    assert out['hazards'] and out['says'] and "forkserver, not fork" in out['says'][0], out
    assert out['two'] == pytest.approx(out['one'], abs=1e-5), out
    # the cell's function reached the rank with its cached helper, and the rank's traceback shows its line
    assert 'ValueError: bad width 3' in out['failed'], out['failed']
    assert "raise ValueError('bad width %d' % width())  # the cell's own line" in out['failed'], out['failed']


SCRIPT = """
RAN_IN = os.getpid()  # the process that ran this script's top level
def in_rank():  # did this rank run the script again (as `__main__`)?
    return getattr(sys.modules['__main__'], 'RAN_IN', None) == os.getpid(), train('ddp')
"""


@pytest.mark.parametrize('method', ['forkserver', 'spawn'])
@pytest.mark.parametrize('guarded', [False, True])
def test_a_script_launches_with_or_without_a_main_guard(tmp_path, method, guarded):
    """A script whose top level calls launch, unguarded, used to run again in every spawned rank, which launched again
    and died ("rank 1 died with exit code 1"). Its functions travel by value, so the ranks no longer run it; a guarded
    script still runs again in each rank (as `torch.multiprocessing` does: its top-level settings hold there)."""
    call = (f"res, says = launch(in_rank, nprocs=2, start_method={method!r})\n"
            "print(json.dumps(dict(res=res, one=train('single'))))")
    body = textwrap.indent(call, '    ') if guarded else call
    script = tmp_path / 'train.py'
    script.write_text(HEAD + SCRIPT + ("if __name__ == '__main__':\n" if guarded else '') + body + '\n')
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       env=cpu_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [ran for ran, _ in out['res']] == [guarded, guarded], out
    assert all(losses == pytest.approx(out['one'], abs=1e-5) for _, losses in out['res']), out  # DDP = one process


CELL = """from dtnb.core.utils import cache
@cache
def width(): return 3

def cell_fn():
    raise ValueError('bad width %d' % width())  # the cell's own line
"""


@pytest.mark.long  # a measured cause, 6 s: bash run.sh test-long
def test_the_thread_pool_matters_only_for_ranks_of_more_than_one_thread():
    out = _run("""
        torch.set_num_threads(2)
        a = torch.randn(1024, 1024); a @ a   # starts OpenMP's pool (where torch uses OpenMP)
        def nthreads(): return torch.get_num_threads()
        (n1,), says1 = launch(nthreads, nprocs=1)              # forked: one thread each, which never uses the pool
        (n2,), says2 = launch(nthreads, nprocs=1, threads=2)   # two asked for: spawned, saying why
        print(json.dumps(dict(one=fork_hazards(1), two=fork_hazards(2), n1=n1, n2=n2, says1=says1, says2=says2,
                              omp='OpenMP' in torch.__config__.parallel_info())))
    """)
    assert out['one'] == [] and out['says1'] == [] and out['n2'] == 2, out
    if out['omp']:
        assert any('thread pool' in h for h in out['two']) and out['n1'] == 1, out
        assert len(out['says2']) == 1 and 'thread pool' in out['says2'][0], out
