# Quick start: `make serve` (install + run the daemon), `make test` (install + run the tests;
# `make test-unit` for the fast loop, `make test-integration` for the rest).
# `make docs` builds the manual (docs/) into site/ in strict mode.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
ARGS   ?=
# `make install DESTDIR=/tmp/root` stages an install; without DESTDIR it installs here.
DESTDIR ?=
BINARY := dist/applianced/applianced
# The FinOps Foundation's focus-validator (tests/integration/test_focus_validator.py) needs Python >= 3.12: its
# own venv beside the 3.11 one, made when such a Python is found (else those tests skip).
PYTHON312 ?= $(shell for p in python3.12 python3.13 $$HOME/.pyenv/versions/3.1[23]*/bin/python3; do \
  $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)
FOCUS  := .venv-focus/.installed
SOURCES := $(shell find appliance packaging -name '*.py' -o -name '*.tcss' -o -name '*.spec' \
             -o -name '*.c' -o -name '*.h')

.PHONY: serve test test-unit test-integration docs bench bench-serving binary install promtool clean

# The CPU build of torch first: a bare `torch` from an index is a multi-GB CUDA build.
$(DEPS): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,docs,structured]'
	touch $@

# pyarrow < 20: the validator pins numpy 1.x, and newer pyarrow needs numpy 2.
# Not installable (offline, no index): a note, and the validator tests skip.
$(FOCUS):
	@test -x .venv-focus/bin/python || $(PYTHON312) -m venv .venv-focus
	@.venv-focus/bin/python -m pip install -q focus-validator==2.2.1 'pyarrow<20' && touch $@ \
	  || echo "make: focus-validator not installed; tests/integration/test_focus_validator.py skips the validator run" >&2

serve: $(DEPS)
	$(BIN)/applianced serve $(ARGS)

# `make test` runs both kinds, unit then integration, in one pytest run (one summary).
# The binary's smoke tests run when dist/ holds a build (.ci/run builds one first); a
# build older than the sources is rebuilt first so they never test stale code.
INTEGRATION_DEPS := promtool $(if $(PYTHON312),$(FOCUS)) $(if $(wildcard $(BINARY)),binary)

test: $(DEPS) $(INTEGRATION_DEPS)
	$(BIN)/python -m pytest -q $(ARGS)

# The fast loop: tests/unit starts no daemon, no process, no server (under a minute).
test-unit: $(DEPS)
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

# Real daemons, worker processes, Prometheus's tools, the binary when built.
test-integration: $(DEPS) $(INTEGRATION_DEPS)
	$(BIN)/python -m pytest -q tests/integration $(ARGS)

# The manual as a static site (MkDocs, Material theme). Strict: a broken link or anchor,
# or a page missing from mkdocs.yml's nav, fails the build (tests/integration/test_docs_site.py runs it too).
docs: $(DEPS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# promtool checks and unit-tests deploy/prometheus/ (and the fleet test runs a real
# Prometheus): Debian's `prometheus` package, installed here when missing and root.
promtool:
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && echo "installing Debian's prometheus package (promtool)" \
	  && (apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
	      || (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null)); } \
	  || { echo "make: promtool is missing: as root, apt-get install prometheus (Debian/Ubuntu)" >&2; exit 1; }

# The single binary (PyInstaller onedir, packaging/applianced.spec): dist/applianced/.
binary: $(BINARY)

$(BINARY): $(DEPS) $(SOURCES)
	$(BIN)/python -m pip install -q 'pyinstaller>=6.10'   # as in pyproject's [binary] extra
	PYTHONPATH=$(CURDIR) $(BIN)/pyinstaller --noconfirm --clean --log-level WARN \
	  --distpath dist --workpath build/pyinstaller packaging/applianced.spec
	touch $@

# FHS places: the binary tree in /opt, units and the sysusers file for systemd, a
# commented default config in /etc (kept if present), the default model in /var/lib.
install: $(BINARY)
	rm -rf $(DESTDIR)/opt/applianced.new
	mkdir -p $(DESTDIR)/opt
	cp -a dist/applianced $(DESTDIR)/opt/applianced.new
	install -m 644 README.md $(DESTDIR)/opt/applianced.new/README.md
	cp -r docs $(DESTDIR)/opt/applianced.new/docs        # the manual's pages, beside the README
	rm -rf $(DESTDIR)/opt/applianced.old
	if [ -e $(DESTDIR)/opt/applianced ]; then mv $(DESTDIR)/opt/applianced $(DESTDIR)/opt/applianced.old; fi
	mv $(DESTDIR)/opt/applianced.new $(DESTDIR)/opt/applianced
	rm -rf $(DESTDIR)/opt/applianced.old
	install -d $(DESTDIR)/usr/local/bin
	ln -sfn /opt/applianced/applianced $(DESTDIR)/usr/local/bin/applianced
	install -D -m 644 systemd/applianced.service $(DESTDIR)/etc/systemd/system/applianced.service
	install -D -m 644 systemd/applianced.socket $(DESTDIR)/etc/systemd/system/applianced.socket
	install -D -m 644 systemd/applianced.sysusers $(DESTDIR)/usr/lib/sysusers.d/applianced.conf
	install -d -m 755 $(DESTDIR)/etc/applianced
	test -e $(DESTDIR)/etc/applianced/config.toml || \
	  $(BIN)/python packaging/default_config.py docs/configuration.md > $(DESTDIR)/etc/applianced/config.toml
	install -d -m 750 $(DESTDIR)/var/lib/applianced
	$(DESTDIR)/opt/applianced/applianced model ensure-default $(DESTDIR)/var/lib/applianced
	if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then \
	  systemd-sysusers /usr/lib/sysusers.d/applianced.conf && systemctl daemon-reload; fi
	@echo "installed; start it: systemctl enable --now applianced"

bench: bench-serving

bench-serving: $(DEPS)
	$(BIN)/python bench/bench_serving.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build dist site
