#!/bin/bash
# install.sh - install glmspark on this node: binaries, the ops scripts, the systemd units,
# /etc/glmspark (settings and recipe, never overwritten), the kernel settings, and on the
# head node the nginx site. Idempotent: run it again after every build or upgrade.
#
#   ops/install.sh [--role head|worker] [--build DIR] [--prefix DIR] [--root DIR]
#                  [--fcgi-procs N]
#
# --role     head (default): everything; worker: no nginx site, no fcgi socket
# --fcgi-procs  glmspark-fcgi instances behind nginx on the head (default 2): units
#            glmspark-fcgi@1..N.socket enabled, their sockets the nginx site's upstream
# --build    the build directory with bin/ (default build/)
# --prefix   /usr/local by default: bin/, lib/glmspark/ (scripts), share/glmspark/
#            (recipes, sql, web, README.md)
# --root     install under DIR and touch nothing outside it: no user, no systemctl, no
#            sysctl (packaging, tests)
# Afterwards: edit /etc/glmspark/env and /etc/glmspark/recipe.conf, then the README's
# "Operations guide".
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
role="head"
build=$src/build
prefix=/usr/local
root=""
fcgi_procs=2
while [ $# -gt 0 ]; do
    case $1 in
    --role) [ $# -ge 2 ] || exit 2; role=$2; shift 2 ;;
    --build) [ $# -ge 2 ] || exit 2; build=$2; shift 2 ;;
    --prefix) [ $# -ge 2 ] || exit 2; prefix=$2; shift 2 ;;
    --root) [ $# -ge 2 ] || exit 2; root=$(mkdir -p "$2" && cd "$2" && pwd); shift 2 ;;
    --fcgi-procs) [ $# -ge 2 ] || exit 2; fcgi_procs=$2; shift 2 ;;
    *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
case $role in head | worker) ;; *) echo "install: --role is head or worker" >&2; exit 2 ;; esac
case $fcgi_procs in [1-9] | [1-9][0-9]) ;; *) echo "install: --fcgi-procs is 1 to 99" >&2; exit 2 ;; esac
say() { echo "install: $*" >&2; }
bindir=$prefix/bin
libexecdir=$prefix/lib/glmspark
sharedir=$prefix/share/glmspark
units=$root/etc/systemd/system
etc=$root/etc/glmspark
run_dir=/var/lib/glmspark/run

# install_file MODE SRC DEST: copy only when different (so a second run changes nothing).
changed=0
install_file() {
    if [ -f "$3" ] && cmp -s "$2" "$3"; then return 0; fi
    mkdir -p "$(dirname "$3")"
    install -m "$1" "$2" "$3.tmp.$$"
    mv -f "$3.tmp.$$" "$3"
    changed=$((changed + 1))
    say "installed $3"
}
# render SRC DEST: the unit with its @PLACEHOLDERS@ filled.
render() {
    local tmp
    tmp=$(mktemp)
    sed -e "s|@BINDIR@|$bindir|g" -e "s|@LIBEXECDIR@|$libexecdir|g" -e "s|@DOCDIR@|$sharedir|g" \
        "$1" >"$tmp"
    install_file 644 "$tmp" "$2"
    rm -f "$tmp"
}

for b in glmspark glmspark-engine glmspark-fcgi; do
    [ -x "$build/bin/$b" ] || { say "missing $build/bin/$b: build first (README: Building)"; exit 1; }
    install_file 755 "$build/bin/$b" "$root$bindir/$b"
done
for s in launch-cluster.sh cleanup.sh cluster-lib.sh apply-sysctl.sh oom-guard.sh \
    pagecache-dropper.sh; do
    install_file 755 "$src/ops/$s" "$root$libexecdir/$s"
done
for f in "$src"/ops/recipes/*.conf; do install_file 644 "$f" "$root$sharedir/recipes/${f##*/}"; done
for f in "$src"/sql/*; do [ -f "$f" ] && install_file 644 "$f" "$root$sharedir/sql/${f##*/}"; done
install_file 644 "$src/README.md" "$root$sharedir/README.md"

# Settings: created once, never overwritten (they are the operator's).
mkdir -p "$etc"
if [ ! -f "$etc/env" ]; then
    sed -e "s|^GLMSPARK_BIN=.*|GLMSPARK_BIN=$bindir|" "$src/ops/env.example" >"$etc/env"
    say "created $etc/env: edit the nodes, addresses and interfaces"
fi
if [ ! -f "$etc/recipe.conf" ]; then
    cp "$src/ops/recipes/glm-5.2-nvfp4-reap-469b.conf" "$etc/recipe.conf"
    say "created $etc/recipe.conf (GLM-5.2-NVFP4-REAP-469B on three nodes)"
fi

# Units and drop-ins.
render "$src/ops/systemd/glmspark-engine.service" "$units/glmspark-engine.service"
render "$src/ops/systemd/glmspark-oom-guard.service" "$units/glmspark-oom-guard.service"
render "$src/ops/systemd/glmspark-pagecache-dropper.service" "$units/glmspark-pagecache-dropper.service"
render "$src/ops/systemd/ssh-oom.conf" "$units/ssh.service.d/glmspark-oom.conf"
if [ "$role" = head ]; then
    render "$src/ops/systemd/glmspark-fcgi@.socket" "$units/glmspark-fcgi@.socket"
    render "$src/ops/systemd/glmspark-fcgi@.service" "$units/glmspark-fcgi@.service"
    # Units of releases before the instances (one socket, /run/glmspark/fcgi.sock).
    for old in glmspark-fcgi.socket glmspark-fcgi.service; do
        [ -f "$units/$old" ] || continue
        [ -n "$root" ] || systemctl disable --now "$old" 2>/dev/null || true
        rm -f "$units/$old"
        say "removed $units/$old (now glmspark-fcgi@N)"
    done
    render "$src/ops/systemd/nginx-glmspark.conf" "$units/nginx.service.d/glmspark.conf"
    # The web UI and the nginx site (created once; the TLS files are the operator's).
    for f in "$src"/web/*; do [ -f "$f" ] && install_file 644 "$f" "$root$sharedir/web/${f##*/}"; done
    site=$root/etc/nginx/conf.d/glmspark.conf
    if [ ! -f "$site" ]; then
        mkdir -p "$(dirname "$site")"
        servers=""
        for k in $(seq "$fcgi_procs"); do servers+="server unix:/run/glmspark/fcgi-$k.sock; "; done
        sed -e "s|@FCGI_SERVERS@|$servers|g" -e "s|@LISTEN_ADDR@|0.0.0.0|g" \
            -e "s|@HTTP_PORT@|80|g" -e "s|@HTTPS_PORT@|443|g" \
            -e "s|@SERVER_NAME@|$(hostname -f 2>/dev/null || hostname)|g" \
            -e "s|@ACCESS_LOG@|/var/log/nginx/glmspark-access.log|g" \
            -e "s|@TLS_CERT@|/etc/glmspark/tls/cert.pem|g" -e "s|@TLS_KEY@|/etc/glmspark/tls/key.pem|g" \
            -e "s|@WEB_ROOT@|$sharedir/web|g" -e "s|@IP_RATE@|50|g" -e "s|@IP_BURST@|100|g" \
            -e "s|@FASTCGI_PARAMS@|/etc/nginx/fastcgi_params|g" \
            "$src/nginx/glmspark.conf.in" >"$site"
        say "created $site: put the certificate and key in /etc/glmspark/tls/"
    fi
fi
"$src/ops/apply-sysctl.sh" ${root:+--root "$root"}

if [ -n "$root" ]; then
    say "installed under $root ($changed file(s) changed); nothing outside it touched"
    exit 0
fi
getent passwd glmspark >/dev/null || useradd --system --home-dir /var/lib/glmspark \
    --shell /usr/sbin/nologin glmspark
mkdir -p "$run_dir" /etc/glmspark/tls
chown glmspark: /var/lib/glmspark "$run_dir"
chmod 750 /etc/glmspark/tls
systemctl daemon-reload
systemctl enable --now glmspark-oom-guard.service glmspark-pagecache-dropper.service
systemctl try-restart ssh.service 2>/dev/null || true
if [ "$role" = head ]; then
    sockets=()
    for k in $(seq "$fcgi_procs"); do sockets+=("glmspark-fcgi@$k.socket"); done
    systemctl enable "${sockets[@]}"
    say "head: after editing /etc/glmspark/env, start: systemctl start ${sockets[*]} nginx"
    say "(the nginx site, created once, lists fcgi-1..$fcgi_procs.sock: edit its upstream when N changes)"
fi
say "done ($changed file(s) changed). Engine ranks: ops/launch-cluster.sh, or per node"
say "/etc/glmspark/rank + systemctl enable --now glmspark-engine (README: Operations guide)"
