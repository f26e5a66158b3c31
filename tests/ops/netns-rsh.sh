#!/bin/bash
# netns-rsh.sh HOST COMMAND... - ssh's contract for the three-"node" test: run the command
# string on HOST, where HOST is a network namespace listed in GLMSPARK_NETNS_MAP
# ("ADDR=NETNS:NODEDIR ..."). Like an ssh login, the command starts from a clean environment
# (PATH, HOME only) under bash, with the node's own hostname (a UTS namespace) and its own
# run directory: NODEDIR is bind-mounted on GLMSPARK_NETNS_RUN inside a private mount
# namespace (ip netns exec makes one per call), so every node has separate pid files and
# logs, as separate machines would. An unknown HOST fails like an unreachable one (255).
# shellcheck disable=SC2016  # the inner script expands on the node
set -u
host=$1
shift
for entry in ${GLMSPARK_NETNS_MAP:-}; do
    if [ "${entry%%=*}" = "$host" ]; then
        spec=${entry#*=}
        ns=${spec%%:*}
        dir=${spec#*:}
        exec ip netns exec "$ns" unshare --uts env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
            HOME=/root NODE_NS="$ns" NODE_DIR="$dir" RUN_DIR="$GLMSPARK_NETNS_RUN" CMD="$*" \
            bash -c 'hostname "$NODE_NS" && mkdir -p "$RUN_DIR" \
                && mount --bind "$NODE_DIR" "$RUN_DIR" && c=$CMD \
                && unset NODE_NS NODE_DIR RUN_DIR CMD && exec bash -c "$c"'
    fi
done
echo "netns-rsh: connect to host $host: No route to host" >&2
exit 255
