# Sourced by the scripts that build a Go tool from a pinned module's source
# (hack/build-flux-controller.sh, hack/build-flux-cli.sh), which need a copy
# they may edit: the module cache is read-only.
#
# up_to_date OUT: OUT exists and is newer than the building script and this
# file (a new pin names a new OUT).
up_to_date() {
  [ -x "$1" ] && [ "$1" -nt "$0" ] && [ "$1" -nt "${BASH_SOURCE[0]}" ]
}

# module_copy MODULE VERSION: downloads MODULE@VERSION through the module
# proxy and copies it into a fresh writable directory, $work, removed when the
# script exits. The caller defines say.
module_copy() {
  local module=$1 version=$2 info dir
  say "downloading $module@$version from the module proxy"
  info=$(go mod download -json "$module@$version" || true)
  dir=$(sed -n 's/^\t"Dir": "\(.*\)",$/\1/p' <<<"$info")
  if [ -z "$dir" ]; then
    echo "$info" >&2
    echo "could not download $module@$version (is this version served by the module proxy?)" >&2
    exit 1
  fi
  work=$(mktemp -d)
  trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
  cp -R "$dir"/. "$work"/
  chmod -R u+w "$work"
}
