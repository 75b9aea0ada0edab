"""The docs site in a real browser: headless Chromium loads every built page from a local HTTP server.

No broken internal link, every image loads, no console error, every page reachable from the navigation.
Screenshots of the home page and one tutorial are kept in artifacts/. The site is built by
`python tools/docs.py build` when _docs/ is missing or older than a notebook (DTNB_DOCS_EXEC=0 renders the
outputs already saved in the notebooks, as CI does after `nbdev-test --save`)."""
import functools, http.server, os, shutil, socketserver, subprocess, sys, threading
from pathlib import Path
from urllib.parse import urljoin, urlparse
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS, ART = ROOT / '_docs', ROOT / 'artifacts'
CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')


def _stale():
    idx = DOCS / 'index.html'
    if not idx.exists(): return True
    newest = max(p.stat().st_mtime for p in (ROOT / 'nbs').rglob('*.ipynb'))
    return idx.stat().st_mtime < newest


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


def visit(browser, url):
    "Load `url`; return (page, console errors, failed requests)"
    page = browser.new_page(viewport={'width': 1300, 'height': 900})
    errors, failed = [], []
    page.on('console', lambda m: errors.append(m.text) if m.type == 'error' else None)
    page.on('pageerror', lambda e: errors.append(str(e)))
    page.on('requestfailed', lambda r: failed.append(r.url))
    page.on('response', lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(url, wait_until='load')
    return page, errors, failed


def test_every_page_loads_cleanly_and_is_reachable(site, browser):
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob('*.html'))
    assert 'index.html' in pages and len(pages) >= 5
    seen, todo, problems = set(), ['index.html'], []
    while todo:
        rel = todo.pop()
        if rel in seen: continue
        seen.add(rel)
        page, errors, failed = visit(browser, site + rel)
        problems += [f"{rel}: console: {e}" for e in errors] + [f"{rel}: request: {f}" for f in failed]
        broken = page.evaluate("[...document.images].filter(i => !(i.complete && i.naturalWidth > 0))"
                               ".map(i => i.src.slice(0, 80))")
        problems += [f"{rel}: image did not load: {b}" for b in broken]
        for href in page.evaluate("[...document.querySelectorAll('a[href]')].map(a => a.href)"):
            u = urlparse(href)
            if not href.startswith(site): continue  # external: GitHub, published site
            target = u.path[len(urlparse(site).path):] or 'index.html'
            if not (DOCS / target).exists(): problems.append(f"{rel}: broken link {href}")
            elif target.endswith('.html'): todo.append(target)
        page.close()
    assert problems == [], '\n'.join(problems)
    assert sorted(seen) == pages, f"pages not reachable from the navigation: {sorted(set(pages) - seen)}"


def test_outputs_and_plots_are_visible(site, browser):
    page, _, _ = visit(browser, site + 'ddp.html')
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
