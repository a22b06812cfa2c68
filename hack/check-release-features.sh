#!/usr/bin/env bash
# The release binaries (`make release`, the Dockerfile: `-p` of the three)
# must never compile plunger's `test-hooks` feature: it reads
# FLUX_PLUNGER_TEST_* from the environment, one of which turns the uninstall
# fence off. Test builds get it through testkit (a workspace build unifies
# it in), so this checks the exact package selection the release uses.
set -euo pipefail
cd "$(dirname "$0")/.."
line=$(cargo tree --locked -p flux-plunger -p flux-plunger-drain -p flux-plunger-sweep \
  -e normal,build -i plunger -f '{p} [{f}]' --depth 0)
case "$line" in
  *test-hooks*)
    echo "release builds would compile plunger with test-hooks: $line" >&2
    echo "a normal dependency of a release binary turns it on; keep testkit a dev-dependency" >&2
    exit 1
    ;;
esac
echo ">> release builds: $line (no test hooks)"
