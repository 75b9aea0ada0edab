"""The docs site in a real browser: headless Chromium loads every built page from a local HTTP server.

No broken internal link, every image loads, no console error, every page reachable from the navigation.
Screenshots of the home page and one tutorial are kept in artifacts/. `bash run.sh test` builds the site from the
notebook run that just happened (`nbdev-test --save`, `tools/docs.py build --no-exec`, outputs stripped again); this
module builds it (`python tools/docs.py build`, executing every notebook) only when _docs/ is missing or was built
from other notebook sources (DTNB_DOCS_EXEC=0 renders the outputs saved in the notebooks instead)."""
import functools, http.server, json, os, re, shutil, socketserver, subprocess, sys, threading
from pathlib import Path
from urllib.parse import urljoin, urlparse
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS, ART = ROOT / '_docs', ROOT / 'artifacts'
CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')


def _stale():
    "No site, or one built from other notebook sources than these (outputs aside)"
    sys.path.insert(0, str(ROOT / 'tools'))
    from docs import sources_digest
    stamp = DOCS / '.sources'
    return not stamp.exists() or stamp.read_text() != sources_digest()


@pytest.fixture(scope='module')
def site():
    if _stale():
        args = [sys.executable, 'tools/docs.py',
                'build'] + (['--no-exec'] if os.environ.get('DTNB_DOCS_EXEC') == '0' else [])
        r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(DOCS))
    handler.log_message = lambda *a: None
    srv = socketserver.ThreadingTCPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown(); srv.server_close()


@pytest.fixture(scope='module')
def browser():
    if not CHROMIUM:
        if os.environ.get('DTNB_SKIP_BROWSER') == '1': pytest.skip("DTNB_SKIP_BROWSER=1")
        pytest.fail("Chromium not found: `apt-get install chromium` (CI installs it), or set DTNB_SKIP_BROWSER=1")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
            '--disable-component-update', '--disable-sync'])
        yield b
        b.close()


class Tab:
    "One browser tab that loads page after page (a new tab per page costs 3x the time), each with its own problems"
    def __init__(self, browser):
        self.page = browser.new_page(viewport={'width': 1300, 'height': 900})
        self.errors, self.failed = [], []  # of the page loaded last: the handlers read them when they fire
        self.page.on('console', lambda m: self.errors.append(m.text) if m.type == 'error' else None)
        self.page.on('pageerror', lambda e: self.errors.append(str(e)))
        self.page.on('requestfailed', lambda r: self.failed.append(r.url))
        self.page.on('response', lambda r: self.failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)

    def load(self, url):
        "Load `url`; return (page, console errors, failed requests)"
        self.errors, self.failed = [], []
        self.page.goto(url, wait_until='load')
        return self.page, self.errors, self.failed


# A page's prose: its main text less code, outputs and scripts, where no Markdown should be left
PROSE = """(() => { const m = document.querySelector('main').cloneNode(true);
  m.querySelectorAll('pre, code, .output_area, script, style').forEach(e => e.remove());
  return m.innerText; })()"""


def unrendered(text) -> list:
    "Markdown left as text in rendered prose: `**`, a `*word*` emphasis (e.g. in a page's description line)"
    return (re.findall(r'.{0,30}\*\*.{0,30}', text)
            + re.findall(r'.{0,20}(?<![\w*\\])\*[A-Za-z][^*\n]{0,40}[A-Za-z]\*(?![\w*]).{0,20}', text))


def money_as_math(markdown) -> list:
    """Prices that open math: an unescaped `$` before a digit up to the next `$`, holding words and no TeX (Quarto,
    pandoc and Jupyter read `$1,750 on V100s and $250` as math, and `**` around it is then shown as typed)"""
    text = re.sub(r'`[^`]*`', '', markdown)
    spans = re.finditer(r'(?<![\\$])\$(\d[^$\n]*?)(?<!\\)\$', text)
    tex, words = r'[\\^_{}]', r'[A-Za-z]{3,}'
    return [m.group(0) for m in spans if not re.search(tex, m.group(1)) and re.search(words, m.group(1))]


def test_the_checks_for_unrendered_markdown_find_what_they_should():
    assert unrendered("cost **$1,750 on V100s** and") and unrendered("cheapest for *this* model")
    assert not unrendered("a 2 * 3 grid, fit(*args) and 2 * x")
    assert money_as_math("cost **$1,750 over 72 hours on 4 V100s** and **$250 over 8 hours**")
    assert not money_as_math(r"cost **\$1,750 over 72 hours** and **\$250**; $3.23 \cdot 10^{23}$ and $4 + 4 + 8$")


def test_money_is_never_math_in_the_notebooks():
    found = []
    for nb in sorted((ROOT / 'nbs').rglob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            if c['cell_type'] == 'markdown':
                found += [f"{nb.relative_to(ROOT)}: {m} (write \\$ for money)"
                          for m in money_as_math(''.join(c['source']))]
    assert found == [], '\n'.join(found)


def visit(browser, url):
    "Load `url` in a new tab; return (page, console errors, failed requests)"
    return Tab(browser).load(url)


def test_every_page_loads_cleanly_and_is_reachable(site, browser):
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob('*.html'))
    assert 'index.html' in pages and len(pages) >= 5
    seen, todo, problems, tab = set(), ['index.html'], [], Tab(browser)
    while todo:
        rel = todo.pop()
        if rel in seen: continue
        seen.add(rel)
        page, errors, failed = tab.load(site + rel)
        problems += [f"{rel}: console: {e}" for e in errors] + [f"{rel}: request: {f}" for f in failed]
        broken = page.evaluate("[...document.images].filter(i => !(i.complete && i.naturalWidth > 0))"
                               ".map(i => i.src.slice(0, 80))")
        problems += [f"{rel}: image did not load: {b}" for b in broken]
        problems += [f"{rel}: Markdown left in the text: {m!r}" for m in unrendered(page.evaluate(PROSE))]
        for href in page.evaluate("[...document.querySelectorAll('a[href]')].map(a => a.href)"):
            u = urlparse(href)
            if not href.startswith(site): continue  # external: GitHub, published site
            target = u.path[len(urlparse(site).path):] or 'index.html'
            if not (DOCS / target).exists(): problems.append(f"{rel}: broken link {href}")
            elif target.endswith('.html'): todo.append(target)
    tab.page.close()
    assert problems == [], '\n'.join(problems)
    assert sorted(seen) == pages, f"pages not reachable from the navigation: {sorted(set(pages) - seen)}"


def test_outputs_and_plots_are_visible(site, browser):
    page, _, _ = visit(browser, site + 'parallel.ddp.html')
    outputs = page.evaluate("document.querySelectorAll('.output_area').length")
    assert outputs >= 5, "code outputs missing: was the site built from executed notebooks?"
    page.close()
    page, _, _ = visit(browser, site + 'tutorials/pipelines.html')  # the schedule timelines are matplotlib plots
    sizes = page.evaluate("[...document.images].map(i => [i.naturalWidth, i.naturalHeight])")
    assert len(sizes) >= 1 and all(w > 200 and h > 100 for w, h in sizes), sizes
    page.close()


def test_screenshots_kept_as_artifacts(site, browser):
    ART.mkdir(exist_ok=True)
    for name, rel in [('home', 'index.html'), ('tutorial', 'tutorials/ddp_notebook.html')]:
        page, _, _ = visit(browser, site + rel)
        page.screenshot(path=str(ART / f'{name}.png'), full_page=True)
        page.close()
        assert (ART / f'{name}.png').stat().st_size > 10_000


def test_readme_lists_every_tutorial_of_the_sidebar():
    sys.path.insert(0, str(ROOT / 'tools'))
    from docs import sidebar
    tutorials = [p for section, items in sidebar() if section == 'Tutorials' for p in items]
    readme = (ROOT / 'README.md').read_text()
    assert len(tutorials) >= 10 and [p for p in tutorials if p.replace('.ipynb', '.html') not in readme] == []
