"""A real SLURM on one machine for tests and tutorials: `tools/slurm.sh` (munged, slurmctld on host 1, one slurmd per
namespace host of `tools/cluster.sh`) driven from Python. Nodes are host1..hostN at 10.77.0.1..N.

    with SlurmCluster(2) as s:
        job = s.sbatch('examples/slurm.sbatch', '--steps', '6', env=env, output='/tmp/job-%j.out')
        s.wait(job)                      # until it ended (COMPLETED, FAILED, ...); s.state(job) while it runs
"""
import os, shutil, subprocess, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'tools' / 'slurm.sh'
DAEMONS = ('munged', 'slurmctld', 'slurmd', 'sbatch', 'srun', 'scontrol')


def slurm_unavailable():
    "Why SLURM cannot be started here, or None when it can"
    from cluster import cluster_unavailable
    if (why := cluster_unavailable()): return why
    if (miss := [c for c in DAEMONS if shutil.which(c) is None]):
        return (f"no {', '.join(miss)}: install with `apt-get install -y slurm-wlm munge` "
                "(`bash run.sh test-long` does as root)")
    return None


class SlurmCluster:
    "SLURM on `n` namespace hosts, `cpus` CPUs each; `down()` (or leaving the `with`) stops it and removes its folder"
    def __init__(self, n:int=2, cpus:int=1):
        r = subprocess.run(['bash', str(SCRIPT), 'up', str(n), '--cpus', str(cpus)], capture_output=True, text=True,
                           timeout=90)
        if r.returncode: raise RuntimeError(f"slurm.sh up {n}: {r.stderr.strip()}")
        self.n, self.dir = n, Path(r.stdout.strip().splitlines()[-1])
        self.conf = self.dir / 'slurm.conf'

    def argv(self, argv, host:int=1) -> list[str]:
        "The command line that runs `argv` on `host` with this SLURM's configuration"
        return ['bash', str(SCRIPT), 'exec', str(self.dir), str(host), '--', *map(str, argv)]

    def run(self, *argv, host:int=1, env=None, check=True, timeout=60) -> str:
        "Run a client command (`sinfo`, `scontrol ...`) on `host`; its stdout"
        r = subprocess.run(self.argv(argv, host), capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
        if check and r.returncode: raise RuntimeError(f"{' '.join(map(str, argv))}: {r.stderr.strip()}")
        return r.stdout

    def sbatch(self, script, *args, env=None, output=None, options=()) -> int:
        "Submit `script args...` from the repository root; its job id"
        out = ['-o', str(output)] if output else []
        return int(self.run('sbatch', '--parsable', *out, *options, script, *args, env=env).strip().split(';')[0])

    FINAL = ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'OUT_OF_MEMORY', 'BOOT_FAIL', 'DEADLINE',
             'PREEMPTED')

    def state(self, job:int) -> str:
        """The job's state ('PENDING', 'RUNNING', 'COMPLETED', ...; every state, `squeue -t all`), or '' once the
        controller forgot it; a failed query (slurmctld busy with a requeue) is asked again"""
        for _ in range(60):
            r = subprocess.run(self.argv(['squeue', '-h', '-t', 'all', '-j', job, '-o', '%T']), capture_output=True,
                               text=True, timeout=60, cwd=ROOT)
            if r.returncode == 0: return r.stdout.strip()
            if 'Invalid job id' in r.stderr: return ''
            time.sleep(0.5)
        raise RuntimeError(f"squeue -j {job} kept failing: {r.stderr.strip()}")

    def show(self, job:int) -> str:
        "`scontrol show job`, and what the daemons' logs say of the job: for a failing test's message"
        logs = [f"{f.name}: {l}" for f in sorted((self.dir / 'log').glob('slurm*.log'))
                for l in f.read_text(errors='replace').splitlines() if f"JobId={job} " in l or f"job {job} " in l
                or f"job{job} " in l or f"StepId={job}." in l or f"job {job}:" in l or f"JobId={job}:" in l]
        return self.run('scontrol', 'show', 'job', job, check=False).strip() + '\n' + '\n'.join(logs[-60:])

    def wait(self, job:int, timeout:float=300, until=None):
        "Poll until `until(state)` (default: the job ended, `FINAL`); the last state; `self.seen`: the states passed"
        until, end, self.seen = until or (lambda s: s in self.FINAL or s == ''), time.monotonic() + timeout, []
        while not until(s := self.state(job)):
            if not self.seen or self.seen[-1] != s: self.seen.append(s)
            if time.monotonic() > end: raise TimeoutError(f"job {job} still {s} after {timeout}s: {self.show(job)}")
            time.sleep(0.5)
        self.seen.append(s)
        return s

    def requeue(self, job:int):
        "`scontrol requeue` the job, then lift the start delay (about 2 minutes) SLURM gives a requeued job"
        self.run('scontrol', 'requeue', job)
        self.release(job)

    def release(self, job:int, timeout:float=60):
        """Once the requeued job is back in the queue and its nodes are idle again (its ranks may take seconds to save
        and stop), start it now. A slurmd revokes the old incarnation's credential when it kills it and refuses a
        launch whose credential is from the same second or earlier ("Killing non-startable batch JobId=4: Job
        credential revoked", and the job FAILS): the delay SLURM gives a requeued job is there for that, and this
        start waits for the nodes, then for a later second"""
        self.wait(job, timeout, until=lambda s: s == 'PENDING')
        end = time.monotonic() + timeout
        while (nodes := self.run('sinfo', '-h', '-N', '-o', '%T').split()) != ['idle'] * self.n:
            if time.monotonic() > end: raise TimeoutError(f"nodes still {nodes} {timeout}s after job {job} stopped")
            time.sleep(0.2)
        time.sleep(1.5)
        self.run('scontrol', 'update', f'jobid={job}', 'StartTime=now')

    def down(self):
        if self.dir and self.dir.exists():
            subprocess.run(['bash', str(SCRIPT), 'down', str(self.dir)], capture_output=True, timeout=60)
        self.dir = None

    def __enter__(self): return self
    def __exit__(self, *exc): self.down()
    def __del__(self):  # a notebook cell that failed before its down(): the kernel's exit stops the daemons
        try: self.down()
        except Exception: pass
