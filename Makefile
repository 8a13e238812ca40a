# The two set-up commands of the README: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup criu worker worker-torch compat torch browser services slurm pods cc soak-tools demo ui demo-fleet demo-slurm demo-k8s test test-fast test-unit soak bench faults clean

setup: $(STAMP) criu

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check 'pip>=25.1'  # --group: PEP 735's dependency groups
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[amazon,cncf-kubernetes,ssh,gpu,s3]' --group dev
	touch $(STAMP)

criu:
	bash scripts/install-criu.sh

# A worker's own interpreter and environment, as the official Airflow image has one: Debian's python3
# with our package (built and installed as a wheel, not editable) and Airflow, where any user may run them
# (the tests' .venv runs a Python that lives in root's 0700 home). The tests run task processes and Celery
# workers that are not root with it (issue 49), so it has the Celery provider and PostgreSQL's drivers as
# the official image does; our package is put in again each time, so it is the tree's as it is now.
# sudo: the test run's Airflow stack runs its tasks as nobody through Airflow's own impersonation (run_as_user);
# acl: an agent test denies nobody a folder by ACL.
WORKER := /opt/cedana-airflow/worker
worker: $(WORKER)/.installed
	@{ command -v sudo >/dev/null && command -v setfacl >/dev/null; } || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends sudo acl; }
	$(WORKER)/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall .

$(WORKER)/.installed: pyproject.toml setup.py Makefile
	@/usr/bin/python3 -c 'import ensurepip' 2>/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv; }
	/usr/bin/python3 -m venv $(WORKER)
	$(WORKER)/bin/python -m pip install -q --disable-pip-version-check '.[amazon,cncf-kubernetes,ssh,gpu]' numpy \
	  'apache-airflow-providers-celery>=3.10' 'celery>=5.5,<5.7' 'psycopg2-binary>=2.9' 'asyncpg>=0.29'
	chmod -R a+rX $(WORKER)
	touch $@

# Airflow 3.1 and 3.2 beside the 3.3 of .venv, each in a venv of its own from the set pinned in tests/compat/
# (tests/integration/test_airflow_compat.py installs the built wheel into a copy of each and runs a task).
compat:
	@for lock in tests/compat/airflow-*.txt; do bash scripts/compat_venv.sh "$$lock"; done

# PyTorch's CPU build (about 200 MB) for the real training jobs of the tests and the soak; not a
# dependency of the package. The worker environment gets it too (`make test`): the stack's torch jobs
# run as nobody, with the worker's interpreter.
TORCH := $(VENV)/.torch
torch: $(TORCH)
$(TORCH): $(STAMP)
	$(BIN)/python -m pip install -q --disable-pip-version-check 'torch==2.13.0+cpu'
	touch $(TORCH)
worker-torch: $(WORKER)/.torch
$(WORKER)/.torch: $(WORKER)/.installed
	$(WORKER)/bin/python -m pip install -q --disable-pip-version-check 'torch==2.13.0+cpu'
	chmod -R a+rX $(WORKER)
	touch $@

# The UI tests drive Debian's Chromium with Playwright (a browser download is not possible here).
browser:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }

# PostgreSQL and Redis for the two-worker deployment (scripts/fleet_stack.py starts throwaway ones).
services:
	@{ command -v redis-server >/dev/null && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql redis-server; }

# munge, slurmctld and slurmd for the Slurm route (scripts/slurm_cluster.py starts throwaway ones; no
# systemd unit is enabled or started), and openssh-server's sshd for its login node
# (scripts/ssh_login.py runs one on loopback with its own config and keys; /etc/ssh is not used).
slurm:
	@{ command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null && test -x /usr/sbin/sshd; } || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge openssh-server; }

# podman and mmdebstrap for the Kubernetes route's pods (scripts/pod_runtime.py plays them with a private
# configuration and storage; the machine's own containers.conf and images are never touched).
PODS := podman runc fuse-overlayfs slirp4netns uidmap catatonit containernetworking-plugins iptables mmdebstrap
pods:
	@{ command -v podman >/dev/null && command -v runc >/dev/null && command -v mmdebstrap >/dev/null && ls /usr/lib/cni/bridge >/dev/null 2>&1; } || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(PODS); }

# gcc and libc's headers: the differential lazy-restore test builds tests/workloads/map_churn.c.
cc:
	@{ command -v gcc >/dev/null && test -e /usr/include/pthread.h; } || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev; }

# The soak's compilers and runtimes for its other shapes (scripts/soak.py): gcc and libc's headers for the
# C workloads (maps, churn), Go, a JDK that runs a single-file source (jvm), Node.js; each only when missing.
soak-tools:
	@pkgs="$$(command -v gcc >/dev/null || echo gcc; test -e /usr/include/pthread.h || echo libc6-dev; \
	  command -v go >/dev/null || echo golang-go; command -v java >/dev/null || echo openjdk-17-jdk-headless; \
	  command -v node >/dev/null || echo nodejs)"; \
	[ -z "$$pkgs" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkgs; }

demo: setup
	$(BIN)/python scripts/demo.py

# The demo's Airflow home in Airflow's UI (the demo's four Airflow parts, no login), until Ctrl-C.
ui: setup
	$(BIN)/python scripts/ui.py

demo-fleet: setup services worker
	$(BIN)/python scripts/demo_fleet.py

demo-slurm: setup slurm worker
	$(BIN)/python scripts/demo_slurm.py

# The wrap route's pods, played by podman: a node loss and a drain, each resumed by the retry's pod
# (the image is built from deploy/Containerfile and our wheel, cached in /var/cache/cedana-airflow/images as root).
demo-k8s: setup pods
	$(BIN)/python scripts/demo_k8s.py

# The suite in parallel pytest-xdist workers: most end-to-end tests wait on heartbeats and Airflow's loops,
# so their waits overlap (tests/harness.py; docs/testing.md has the budget and the latest figures).
TEST_WORKERS ?= 5
test: setup torch browser services slurm pods cc worker worker-torch compat
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# The inner loop: units and the pieces that need no Airflow stack, cluster or pod (under 3 minutes).
test-fast: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not integration"

test-unit: test-fast

# Checkpoint -> kill -> restore cycles compared with uninterrupted runs (scripts/soak.py):
# `make soak` runs each shape x (mode, store, lazy-pages daemon) once (72 rounds); ROUNDS=N or MINUTES=M
# for a long one; ALONGSIDE=1 runs the end-to-end tests beside it all the while (they need `make test`'s
# services installed).
soak: setup torch soak-tools
	$(BIN)/python scripts/soak.py $(if $(MINUTES),--minutes $(MINUTES),$(if $(ROUNDS),--rounds $(ROUNDS))) \
	  $(if $(ALONGSIDE),--alongside '$(BIN)/python -m pytest -q -m integration -k "not soak" -p no:cacheprovider') $(SOAK_ARGS)

bench: setup
	$(BIN)/python bench/run.py

# Every fault at every step of a heartbeat and a restore (about 15 minutes), then 32 supervisors under
# load for 3 minutes; both rewrite their tables in docs/faults.md. The suite runs a slice of the first.
faults: setup
	$(BIN)/python tests/faults/fault_matrix.py --write docs/faults.md
	$(BIN)/python tests/faults/load.py --write docs/faults.md

clean:
	rm -rf $(VENV) .cedana .pytest_cache
