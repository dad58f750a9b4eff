"""A real JupyterLab on a loopback port, driven by the system's Chromium through Playwright.

What the tests read is what the page shows (prompts, rendered outputs, images, widgets).
JupyterLab is started with ``expose_app_in_browser`` only to *drive* it (open a file, run a
cell, ask whether the document is dirty) without depending on menu layout.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
# The flags a browser needs on a machine with no display, no sandboxing user namespaces and no
# network beyond loopback (without the networking ones it keeps retrying Google's hosts).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


def find_chromium() -> str | None:
    """The system Chromium (PARLIB_CHROMIUM overrides), or None."""
    explicit = os.environ.get("PARLIB_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).exists() else None
    for name in CHROMIUM_CANDIDATES:
        if Path(name).exists():
            return name
    found = shutil.which("chromium")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """``jupyter lab`` serving `root` on 127.0.0.1 with a random token; everything it writes
    (settings, workspaces, runtime files) stays under `home`."""

    def __init__(self, root: Path, home: Path, log: Path):
        self.root, self.port, self.token = root, free_port(), secrets.token_hex(16)
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)       # the learner's inline figures, not Agg
        env.pop("TQDM_DISABLE", None)     # progress bars render as widgets in the page
        env.pop("PARLIB_CHECK_MODE", None)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
        for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                         ("IPYTHONDIR", "ipython")):
            env[var] = str(home / sub)
        args = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
                f"--LabApp.workspaces_dir={home / 'workspaces'}",
                f"--LabApp.user_settings_dir={home / 'settings'}",
                "--LabApp.news_url=",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--allow-root")
        # No "get Jupyter news?" toast over the notebook (and no request to the internet).
        notify = home / "settings" / "@jupyterlab" / "apputils-extension"
        notify.mkdir(parents=True, exist_ok=True)
        (notify / "notification.jupyterlab-settings").write_text(
            '{"fetchNews": "false", "checkForUpdates": false}')
        self.log = log
        self.proc = subprocess.Popen(args, env=env, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}",
                                            timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"jupyter lab did not answer in {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


# JavaScript run in the page. `app` is JupyterLab's application object.
JS_OPEN = """async (path) => {
  const app = window.jupyterapp;
  await app.restored;
  const w = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  await w.context.ready;
  await w.sessionContext.ready;
  window.__nb = window.__nb || {};
  window.__nb[path] = w;
  app.shell.activateById(w.id);
  return w.id;
}"""

JS_KERNEL_IDLE = """(path) => {
  const w = window.__nb[path];
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle' && k.connectionStatus === 'connected';
}"""

JS_DIRTY = """(path) => {
  const w = window.__nb[path];
  return {model: w.context.model.dirty, tab: w.title.className.includes('jp-mod-dirty')};
}"""

# Records, for every code cell, whether a "[rank k]" line was on the page while the cell's
# prompt still said [*] (the cell was busy), and when rank lines first appeared / the cell
# finished. A MutationObserver sees each DOM change as it happens, so a line that arrives
# just before the cell finishes is still seen as streamed.
JS_WATCH_STREAMING = """(path) => {
  const w = window.__nb[path];
  const seen = window.__streams = window.__streams || {};
  seen[path] = {};
  const scan = (cellNode) => {
    const cells = Array.from(w.content.node.querySelectorAll('.jp-Cell'));
    const i = cells.indexOf(cellNode);
    if (i < 0 || !cellNode.classList.contains('jp-CodeCell')) return;
    const prompt = cellNode.querySelector('.jp-InputPrompt');
    const busy = !!prompt && prompt.textContent.includes('*');
    const out = cellNode.querySelector('.jp-OutputArea');
    const text = out ? out.textContent : '';
    const rec = seen[path][i] = seen[path][i] || {};
    if (busy) { rec.busySince = rec.busySince || performance.now(); delete rec.finished; }
    if (/\\[rank \\d+\\]/.test(text)) {
      rec.firstRankLine = rec.firstRankLine || performance.now();
      if (busy) rec.streamed = true;
    }
    if (!busy && rec.busySince && !rec.finished) rec.finished = performance.now();
  };
  new MutationObserver((muts) => {
    const touched = new Set();
    for (const m of muts) {
      const el = m.target.nodeType === 1 ? m.target : m.target.parentElement;
      const c = el && el.closest('.jp-Cell');
      if (c) touched.add(c);
    }
    touched.forEach(scan);
  }).observe(w.content.node, {subtree: true, childList: true, characterData: true});
}"""

JS_CELLS = """(path) => {
  const w = window.__nb[path];
  return w.content.widgets.map((c, i) => {
    const m = c.model.toJSON();
    const prompt = c.node.querySelector('.jp-InputPrompt');
    const out = c.node.querySelector('.jp-OutputArea');
    const text = (o) => o.text ? [].concat(o.text).join('')
                              : (o.traceback ? o.traceback.join('\\n') : '');
    return {index: i, type: m.cell_type, source: [].concat(m.source).join(''),
            prompt: prompt ? prompt.textContent.trim() : '',
            outputs: (m.outputs || []).map(o => ({type: o.output_type,
                                                 name: o.name || o.ename || '', text: text(o)})),
            shown: out ? out.innerText : '',
            images: c.node.querySelectorAll('.jp-OutputArea img').length};
  });
}"""

JS_RUN_CELL = """async ([path, index]) => {
  const app = window.jupyterapp, w = window.__nb[path];
  app.shell.activateById(w.id);
  w.content.activeCellIndex = index;
  w.content.deselectAll();
  app.commands.execute('notebook:run-cell');  // not awaited: the test watches the page
}"""

JS_RUN_ALL = """async (path) => {
  const app = window.jupyterapp, w = window.__nb[path];
  app.shell.activateById(w.id);
  app.commands.execute('notebook:run-all-cells');
}"""

JS_CLOSE = """async (path) => {
  const w = window.__nb[path];
  await w.sessionContext.shutdown();
  w.context.model.dirty = false;   // the test ran cells; never ask to save
  w.dispose();
}"""
