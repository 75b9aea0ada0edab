#!/usr/bin/env python
"""Build dtnb's docs and README without Quarto.

The published site is built by Quarto on GitHub (`.github/workflows/deploy.yaml`). Quarto cannot be installed on
machines without GitHub access, so this script gives the same pages a build path that runs anywhere:

    python tools/docs.py readme         # write README.md from nbs/index.ipynb
    python tools/docs.py check-readme   # exit 1 when README.md is out of sync with nbs/index.ipynb
    python tools/docs.py build          # execute the notebooks, render every page of nbs/sidebar.yml into _docs/

Pages are `nbdev-proc-nbs` output (show_doc rendered, hidden cells dropped) with the outputs of a fresh execution of
the source notebook, rendered by nbconvert and wrapped with a navigation bar and the sidebar that Quarto also uses.
"""
import argparse, base64, html, json, os, re, shutil, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS, PROC, OUT = ROOT / 'nbs', ROOT / '_proc', ROOT / '_docs'
DOCS_URL = 'https://dtnb-dev.github.io/dtnb/'
REPO_URL = 'https://github.com/dtnb-dev/dtnb'


def _bin(name):
    "Path of a console script next to this interpreter (the venv), else on PATH"
    p = Path(sys.executable).parent / name
    return str(p) if p.exists() else name


def proc_nbs():
    "Run `nbdev-proc-nbs` into _proc/ (show_doc rendered, directives applied)"
    shutil.rmtree(PROC, ignore_errors=True)
    r = subprocess.run([_bin('nbdev-proc-nbs')], cwd=ROOT, capture_output=True, text=True)
    # nbdev-proc-nbs ends by offering to install Quarto, which fails without sudo: only missing pages matter
    return r


def _front(nb):
    "Front matter (title, description, output-file) from a processed notebook's raw first cell"
    c = nb['cells'][0] if nb['cells'] else None
    if not c or c['cell_type'] != 'raw': return {}
    import yaml
    return yaml.safe_load(''.join(c['source']).strip().strip('-')) or {}


def out_name(src: Path) -> str:
    "The page name Quarto gives a notebook: `output-file` of its front matter, relative to nbs/"
    rel = src.relative_to(NBS)
    proc = PROC / rel
    if proc.exists():
        f = _front(json.loads(proc.read_text())).get('output-file')
        if f: return str(rel.parent / f) if str(rel.parent) != '.' else f
    return str(rel.with_suffix('.html'))


def sidebar():
    "Navigation from nbs/sidebar.yml: a list of (section or None, [notebook paths])"
    import yaml
    y = yaml.safe_load((NBS / 'sidebar.yml').read_text())
    out = []
    for item in y['website']['sidebar']['contents']:
        if isinstance(item, str): out.append((None, [item]))
        else: out.append((item['section'], list(item['contents'])))
    return out


# ---------------------------------------------------------------- execution
def _exec_one(path):
    "Execute one source notebook as nbdev-test does; return {cell id or source: outputs}"
    from nbdev.test import _skip_cell
    from nbdev.process import NBProcessor
    from nbdev.config import get_config
    from execnb.shell import CaptureShell
    from fastcore.xtras import working_directory
    fn = NBS / path
    flags = get_config().tst_flags
    flags = flags.split() if isinstance(flags, str) else flags
    os.environ['IN_TEST'] = '1'
    nb = NBProcessor(fn, rm_directives=False, process=True).nb
    k = CaptureShell(fn)
    t0 = time.time()
    with working_directory(fn.parent):
        k.run_all(nb, exc_stop=True, preproc=_skip_cell(nb, flags, []))
    outs = {}
    for c in nb.cells:
        if c.cell_type == 'code' and c.get('outputs'):
            o = [dict(x) for x in c.outputs]
            outs[_strip_directives(c.source)] = json.loads(json.dumps(o, default=str))
    return path, outs, time.time() - t0


def execute(paths, n_workers=2):
    "Execute notebooks in parallel; raise naming each notebook that failed"
    from concurrent.futures import ProcessPoolExecutor
    # Workers find `_exec_one` through the importable module `docs`: executing a notebook replaces `__main__`.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from docs import _exec_one as run_one
    res, failed = {}, []
    with ProcessPoolExecutor(n_workers) as ex:
        futs = {p: ex.submit(run_one, p) for p in paths}
        for p, f in futs.items():
            try:
                _, outs, dt = f.result()
                res[p] = outs
                print(f"  executed {p} in {dt:.1f}s", flush=True)
            except Exception as e:
                failed.append(f"{p}: {type(e).__name__}: {str(e)[-2000:]}")
    if failed: raise SystemExit("docs: these notebooks failed to execute:\n" + '\n'.join(failed))
    return res


# ---------------------------------------------------------------- rendering
_QUARTO_ATTR = re.compile(r'\)\{[^}]*\}')
_DIRECTIVE = re.compile(r'^\s*#\|\s*([\w-]+)\s*:?\s*(.*)$')


def _directives(src):
    return {m.group(1): m.group(2).strip() for m in map(_DIRECTIVE.match, src.splitlines()) if m}


def _strip_directives(src):
    return '\n'.join(l for l in src.splitlines() if not _DIRECTIVE.match(l)).strip()


def _join_lines(o):
    "Outputs stored as lists of lines (as execnb and nbformat on disk do) joined into strings"
    o = dict(o)
    j = lambda v: ''.join(v) if isinstance(v, list) else v
    if 'text' in o: o['text'] = j(o['text'])
    if 'data' in o: o['data'] = {k: j(v) for k, v in o['data'].items()}
    return o


def _clean_nb(nb, outputs):
    "Prepare a processed notebook for nbconvert: outputs attached, directives applied, extra keys dropped"
    import nbformat
    cells = []
    for c in nb['cells'][1:] if _front(nb) else nb['cells']:
        src = ''.join(c['source']) if isinstance(c['source'], list) else c['source']
        if c['cell_type'] == 'raw': continue
        if c['cell_type'] == 'markdown':
            if 'AUTOGENERATED' in src: continue
            cells.append(nbformat.v4.new_markdown_cell(_QUARTO_ATTR.sub(')', src)))
            continue
        d = _directives(src)
        outs = c.get('outputs') or outputs.get(_strip_directives(src), [])
        code = _strip_directives(src)
        cell = nbformat.v4.new_code_cell(code)
        cell.outputs = [nbformat.from_dict(_join_lines(o)) for o in outs]
        for o in cell.outputs:
            if o.get('output_type') in ('execute_result', 'display_data'):
                o.setdefault('metadata', {})
                md = o.get('data', {}).get('text/markdown')
                if md is not None: o['data']['text/markdown'] = _QUARTO_ATTR.sub(')', md if isinstance(md,
                    str) else ''.join(md))
        tags = []
        if d.get('echo') == 'false' or not code: tags.append('remove_input')
        if d.get('output') == 'false': tags.append('remove_output')
        cell.metadata['tags'] = tags
        cells.append(cell)
    out = nbformat.v4.new_notebook(cells=cells)
    out.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}
    out.metadata['language_info'] = {'name': 'python'}
    return out


def _link_fix(body, pages, here):
    "Point links at .ipynb sources to their built pages, relative to the page `here`"
    depth = here.count('/')
    def sub(m):
        href = m.group(1)
        if href.startswith(DOCS_URL):  # doclinks to the published site: the page built here
            href = os.path.relpath(href[len(DOCS_URL):] or 'index.html', os.path.dirname(here) or '.')
            return f'href="{href}"'
        if href.startswith(('http:', 'https:', '#', 'data:', 'mailto:')): return m.group(0)
        path, frag = (href.split('#', 1) + [''])[:2]
        if path.endswith('.ipynb'):
            target = os.path.normpath(os.path.join(os.path.dirname(here), path))
            if target in pages: path = os.path.relpath(pages[target], os.path.dirname(here) or '.')
        return f'href="{path}{"#" + frag if frag else ""}"'
    return re.sub(r'href="([^"]+)"', sub, body)


CSS = """
body{margin:0;font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;color:#222;line-height:1.55}
header{background:#2c3e50;color:#fff;padding:.6rem 1.2rem;display:flex;gap:1.5rem;align-items:center}
header a{color:#fff;text-decoration:none;font-weight:600}
.layout{display:flex}
nav.sidebar{width:250px;min-width:250px;padding:1rem;border-right:1px solid #ddd;font-size:.92rem;min-height:100vh}
nav.sidebar h4{margin:1rem 0 .3rem;font-size:.8rem;text-transform:uppercase;color:#666}
nav.sidebar ul{list-style:none;padding-left:.4rem;margin:0}
nav.sidebar li{margin:.25rem 0}
nav.sidebar a{color:#2c3e50;text-decoration:none}
nav.sidebar a.active{font-weight:700;color:#c0392b}
main{padding:1rem 2rem;max-width:980px;overflow-x:auto;flex:1}
pre{background:#f6f8fa;padding:.6rem;overflow-x:auto;border-radius:4px;font-size:.85rem}
code{font-size:.9em}
table{border-collapse:collapse;margin:.6rem 0}
th,td{border:1px solid #ccc;padding:.2rem .5rem;text-align:left;font-size:.88rem}
.output_area pre{background:#fff;border-left:3px solid #f0a07a;margin-left:.8rem}
.output_stderr pre{border-left-color:#c0392b}
img{max-width:100%}
.prompt{display:none}
.anchor-link{display:none}
.lead{font-size:1.15rem;color:#555}
"""


def _page(title, body, nav_html):
    from pygments.formatters import HtmlFormatter
    hl = HtmlFormatter().get_style_defs('.highlight')
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)} – dtnb</title><link rel="icon" href="data:,"><style>{CSS}\n{hl}</style></head>
<body><header><a href="{{root}}index.html">dtnb</a><a href="{REPO_URL}">GitHub</a></header>
<div class="layout"><nav class="sidebar">{nav_html}</nav><main>{body}</main></div></body></html>"""


def _nav(nav, pages, titles, here):
    rel = lambda p: os.path.relpath(pages[p], os.path.dirname(here) or '.')
    parts = []
    for section, items in nav:
        if section: parts.append(f'<h4>{html.escape(section)}</h4>')
        active = lambda p: ' class=active' if pages[p] == here else ''
        lis = ''.join(f'<li><a href="{rel(p)}"{active(p)}>{html.escape(titles[p])}</a></li>' for p in items)
        parts.append(f'<ul>{lis}</ul>')
    return ''.join(parts)


def build(n_workers=2, execute_nbs=True):
    from nbconvert import HTMLExporter
    from traitlets.config import Config
    t0 = time.time()
    proc_nbs()
    nav = sidebar()
    paths = [p for _, items in nav for p in items]
    missing = [p for p in paths if not (NBS / p).exists()]
    if missing: raise SystemExit(f"docs: sidebar.yml names notebooks that do not exist: {missing}")
    unlisted = sorted(str(p.relative_to(NBS)) for p in NBS.rglob('*.ipynb')
                      if '.ipynb_checkpoints' not in str(p) and not p.name.startswith('_')
                      and str(p.relative_to(NBS)) not in paths)
    if unlisted: raise SystemExit(f"docs: notebooks missing from nbs/sidebar.yml (unreachable pages): {unlisted}")
    not_proc = [p for p in paths if not (PROC / p).exists()]
    if not_proc: raise SystemExit(f"docs: nbdev-proc-nbs did not process {not_proc}")
    outputs = execute(paths, n_workers) if execute_nbs else {p: {} for p in paths}
    pages = {p: out_name(NBS / p) for p in paths}
    titles = {}
    for p in paths:
        fm = _front(json.loads((PROC / p).read_text()))
        titles[p] = 'Home' if p == 'index.ipynb' else str(fm.get('title') or Path(p).stem)
    c = Config()
    c.TagRemovePreprocessor.enabled = True
    c.TagRemovePreprocessor.remove_input_tags = ('remove_input',)
    c.TagRemovePreprocessor.remove_all_outputs_tags = ('remove_output',)
    c.HTMLExporter.exclude_input_prompt = True
    c.HTMLExporter.exclude_output_prompt = True
    exporter = HTMLExporter(config=c, template_name='basic')
    shutil.rmtree(OUT, ignore_errors=True)
    for p in paths:
        nb = json.loads((PROC / p).read_text())
        fm = _front(nb)
        body, _ = exporter.from_notebook_node(_clean_nb(nb, outputs[p]))
        if fm.get('title'):
            lead = html.escape(str(fm.get('description', '')))
            desc = f"<p class='lead'><em>{lead}</em></p>" if fm.get('description') else ''
            body = f"<h1>{html.escape(str(fm['title']))}</h1>{desc}{body}"
        here = pages[p]
        body = _link_fix(body, pages, here)
        root = os.path.relpath('.', os.path.dirname(here) or '.') + '/'
        page = _page(titles[p], body, _nav(nav, pages, titles, here)).replace('{root}', '' if root == './' else root)
        dest = OUT / here
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(page)
    print(f"docs: {len(paths)} pages in {OUT.relative_to(ROOT)}/ ({time.time()-t0:.0f}s)")


# ---------------------------------------------------------------- README
def readme_text():
    "README.md from nbs/index.ipynb: its markdown and code cells (no outputs: they differ per machine)"
    from nbdev.process import NBProcessor
    nb = json.loads((NBS / 'index.ipynb').read_text())
    lines = ['<!-- WARNING: THIS FILE WAS AUTOGENERATED FROM nbs/index.ipynb by tools/docs.py readme! '
             'DO NOT EDIT! -->', '']
    for c in nb['cells']:
        src = ''.join(c['source']) if isinstance(c['source'], list) else c['source']
        d = _directives(src)
        if 'hide' in d or 'default_exp' in d: continue
        if c['cell_type'] == 'markdown':
            src = re.sub(r'\]\((?!https?:)([^)#]+)\.ipynb', lambda m: f"]({DOCS_URL}{_page_of(m.group(1))}", src)
            lines += [src, '']
        elif c['cell_type'] == 'code':
            code = _strip_directives(src)
            if code and d.get('echo') != 'false': lines += ['```python', code, '```', '']
    return '\n'.join(lines).rstrip() + '\n'


def _page_of(stem):
    "Quarto's page name for nbs/<stem>.ipynb: numbered prefix dropped, as nbdev does"
    p = Path(stem)
    name = re.sub(r'^\d+[a-z]?_', '', p.name)
    return str(p.parent / f"{name}.html") if str(p.parent) != '.' else f"{name}.html"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('cmd', choices=['readme', 'check-readme', 'build'])
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--no-exec', action='store_true',
                    help="render the outputs saved in the notebooks (e.g. by nbdev-test --save), not running them")
    a = ap.parse_args(argv)
    os.chdir(ROOT)
    if a.cmd == 'readme':
        (ROOT / 'README.md').write_text(readme_text()); print("wrote README.md")
    elif a.cmd == 'check-readme':
        if (ROOT / 'README.md').read_text() != readme_text():
            raise SystemExit("README.md is out of sync with nbs/index.ipynb: run `python tools/docs.py readme` and "
                             "commit it")
        print("README.md is in sync with nbs/index.ipynb")
    else:
        build(a.workers, not a.no_exec)


if __name__ == '__main__':
    main()
