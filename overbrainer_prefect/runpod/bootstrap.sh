#!/bin/sh
# overbrainer-prefect: the start command of a Runpod pod made for one run.
#
# It claims the run's directory, installs the run's SSH keys (the client's
# public key, and the host key generated for this pod, whose public half the
# client pinned), starts sshd, then watches the pod and deletes it through the
# Runpod API, with the pod's own key (RUNPOD_API_KEY), when one of its bounds
# is reached:
#   - at once when the client marked the run's files retrieved (.pod/retrieved);
#   - OVERBRAINER_RETRIEVE_GRACE seconds after the job ended, unretrieved;
#   - OVERBRAINER_BOOT_GRACE seconds after the pod was created, when no job
#     started (whatever happened to the client);
#   - at max_hours (OVERBRAINER_MAX_HOURS after the pod was created), unless a
#     client following a progressing job renewed .pod/lease in the last
#     OVERBRAINER_LEASE_TTL seconds; the job is asked for a checkpoint
#     (stop.request) OVERBRAINER_CHECKPOINT_LEAD seconds before;
#     A job that ended after that request keeps its pod up to
#     OVERBRAINER_CHECKPOINT_HOLD seconds past max_hours, for its checkpoint to
#     be retrieved;
#   - at max_cost_usd, once the client armed the cost cap (.pod/cap holds the
#     pod's rate, its GPUs and its container disk, and the cap): the time since
#     the pod was created times its rate, less one look of this watchdog and
#     the time a delete takes, so that the spend at deletion stays under the
#     cap; a hard cap, which no lease holds off; the job is asked for a
#     checkpoint a tenth of the budget before (at most
#     OVERBRAINER_CHECKPOINT_LEAD seconds), as before max_hours.
# A pipeline (a fine-tune) may run several jobs on the pod, one after another:
# the client names each job after the first in .pod/job (its run directory),
# and the watchdog watches that job from then on; once a job's files are
# verified and another job follows, the client writes .pod/between, and the pod
# is deleted OVERBRAINER_NEXT_JOB_GRACE seconds later unless the next job
# started. max_hours, max_cost_usd and the lease bound the pod's whole life.
# With OVERBRAINER_KEEP_POD=1 only the boot grace applies.
# A pod that is a node of an instant cluster (NODE_ADDR in its environment)
# writes its rank and private address to .pod/node at its claim; once the
# client wrote its cluster's id to .pod/cluster, each bound deletes the whole
# cluster (a node of one cannot be deleted alone).
#
# Every decision is logged with its reason to <run dir>/.pod/watchdog.log,
# which the client reads (`cost cap armed` is how it knows the cap holds).
#
# Its defaults are a real pod's (sshd on port 22, /workspace, /root/.ssh); the
# simulator of the tests moves paths and port with OVERBRAINER_POD_ROOT,
# OVERBRAINER_WORKSPACE, OVERBRAINER_SSH_PORT, OVERBRAINER_SSH_ADDRESS and
# OVERBRAINER_SSHD. Needs POSIX sh, coreutils, awk, and curl or python3.

set -u
umask 077

ROOT=${OVERBRAINER_POD_ROOT:-/}
ROOT=${ROOT%/}
WORKSPACE=${OVERBRAINER_WORKSPACE:-/workspace}
SSH_PORT=${OVERBRAINER_SSH_PORT:-22}
SSH_ADDRESS=${OVERBRAINER_SSH_ADDRESS:-0.0.0.0}
SSHD=${OVERBRAINER_SSHD:-/usr/sbin/sshd}
API=${OVERBRAINER_API_URL:-https://api.runpod.io/v2}
API=${API%/}
POD_ID=${RUNPOD_POD_ID:-}
RUN_ID=${OVERBRAINER_RUN_ID:-unknown-run}
MAX_HOURS=${OVERBRAINER_MAX_HOURS:-6}
BOOT_GRACE=${OVERBRAINER_BOOT_GRACE:-1800}
RETRIEVE_GRACE=${OVERBRAINER_RETRIEVE_GRACE:-3600}
LEASE_TTL=${OVERBRAINER_LEASE_TTL:-900}
INTERVAL=${OVERBRAINER_WATCH_INTERVAL:-30}
LEAD=${OVERBRAINER_CHECKPOINT_LEAD:-600}
HOLD=${OVERBRAINER_CHECKPOINT_HOLD:-900}
NEXT_GRACE=${OVERBRAINER_NEXT_JOB_GRACE:-300}
DELETE_MARGIN=5     # seconds a delete takes to stop the billing, kept under the cost cap
KEEP=${OVERBRAINER_KEEP_POD:-0}
CREATED=${OVERBRAINER_CREATED_AT:-}
AUTHORIZED_KEY=${OVERBRAINER_AUTHORIZED_KEY:-}

# The secrets stay in this shell's own variables: no process started from here
# gets them in its environment or its arguments.
API_KEY=${RUNPOD_API_KEY:-}
HOST_KEY_B64=${OVERBRAINER_HOST_KEY:-}
unset RUNPOD_API_KEY OVERBRAINER_HOST_KEY OVERBRAINER_BOOTSTRAP

RUN_DIR=$WORKSPACE/overbrainer/$RUN_ID
STATE=$RUN_DIR/.pod
LOG=$STATE/watchdog.log
SSH_DIR=$ROOT/root/.ssh
ETC=$ROOT/etc/ssh
HOST_KEY_FILE=$ETC/overbrainer_host_ed25519_key
SSHD_CONFIG=$ETC/overbrainer_sshd_config
SSHD_LOG=$ROOT/var/log/overbrainer-sshd.log
SSHD_PID=
SSHD_STARTS=0
MAX_SSHD_STARTS=5   # sshd restarts before the watchdog stops trying (the pod still ends at its bounds)

mkdir -p "$STATE" "$SSH_DIR" "$ETC" "$ROOT/var/log" 2>/dev/null
# The container log (what Runpod's /pods/{id}/logs serves) gets this line at every start:
# the client, waiting for SSH, counts it to tell a container that restarts.
printf 'overbrainer-bootstrap: started for run %s on pod %s\n' "$RUN_ID" "$POD_ID"

now() { date +%s; }
precise() { date +%s.%N 2>/dev/null | grep -E '^[0-9]+\.[0-9]+$' || date +%s; }
log() { printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >> "$LOG"; }
# say: logs a line and prints it to the container log too (a pod nobody can reach yet)
say() { log "$*"; printf 'overbrainer-bootstrap: %s\n' "$*"; }
iso() { date -u -d "@$1" +%Y-%m-%dT%H:%M:%SZ 2>/dev/null || printf '@%s' "$1"; }
whole() { awk -v v="$1" 'BEGIN { printf "%d", v + 0 }'; }
mtime() { date -r "$1" +%s 2>/dev/null || stat -c %Y "$1" 2>/dev/null || echo 0; }

BOOT_GRACE=$(whole "$BOOT_GRACE")
RETRIEVE_GRACE=$(whole "$RETRIEVE_GRACE")
LEASE_TTL=$(whole "$LEASE_TTL")
INTERVAL=$(whole "$INTERVAL")
LEAD=$(whole "$LEAD")
HOLD=$(whole "$HOLD")
NEXT_GRACE=$(whole "$NEXT_GRACE")
[ "$INTERVAL" -ge 1 ] || INTERVAL=1

# -- the Runpod API, with the pod's own key -----------------------------------

PY_API='import sys, urllib.error, urllib.request
key = sys.stdin.read().strip()
request = urllib.request.Request(sys.argv[2], method=sys.argv[1], headers={
    "Authorization": "Bearer " + key, "Accept": "application/json",
    "User-Agent": "overbrainer-pod-watchdog"})
try:
    with urllib.request.urlopen(request, timeout=30) as answer:
        print(answer.status)
except urllib.error.HTTPError as error:
    print(error.code)
except Exception:
    print("000")'

# api METHOD PATH: prints the status Runpod answered (000: no answer). The key
# reaches curl or python through its stdin, never through an argument.
api() {
    if command -v curl >/dev/null 2>&1; then
        code=$(printf 'header = "Authorization: Bearer %s"\n' "$API_KEY" | curl -sS -K - \
            -o /dev/null -w '%{http_code}' -X "$1" -H 'Accept: application/json' \
            -H 'User-Agent: overbrainer-pod-watchdog' --connect-timeout 10 --max-time 30 \
            "$API$2" 2>/dev/null)
    elif command -v python3 >/dev/null 2>&1; then
        code=$(printf '%s' "$API_KEY" | python3 -c "$PY_API" "$1" "$API$2" 2>/dev/null)
    else
        code=none
    fi
    case $code in
        [1-5][0-9][0-9]*) printf '%.3s' "$code" ;;
        *) printf '000' ;;
    esac
}

API_OK=0
API_CHECKED=0
check_api() {
    API_CHECKED=$(now)
    if [ -z "$POD_ID" ] || [ -z "$API_KEY" ]; then
        log "api: no RUNPOD_POD_ID or RUNPOD_API_KEY in the pod's environment: this pod cannot delete itself"
        return 1
    fi
    if ! command -v curl >/dev/null 2>&1 && ! command -v python3 >/dev/null 2>&1; then
        log "api: neither curl nor python3 in the image: this pod cannot delete itself"
        return 1
    fi
    code=$(api GET "/pods/$POD_ID")
    if [ "$code" = 200 ]; then
        API_OK=1
        log "api: the Runpod API answers at $API (200 for pod $POD_ID): this pod can delete itself"
        return 0
    fi
    log "api: cannot use the Runpod API at $API (answered $code): this pod cannot delete itself yet; trying again"
    return 1
}

# delete_pod REASON: deletes this pod, trying until Runpod confirms, then waits
# for the end (the pod's processes end with it).
delete_pod() {
    log "decision: delete pod $POD_ID: $1"
    cluster=$(cat "$STATE/cluster" 2>/dev/null)
    [ -z "$cluster" ] || log "cluster: pod $POD_ID is a node of cluster $cluster: the whole cluster is deleted"
    while :; do
        if [ -n "$cluster" ]; then
            code=$(api DELETE "/clusters/$cluster")
        else
            code=$(api DELETE "/pods/$POD_ID")
        fi
        case $code in
            2??)
                log "deleted: Runpod answered $code to the delete of pod $POD_ID [at=$(precise)]"
                break
                ;;
            404)
                log "deleted: pod $POD_ID was already gone (Runpod answered 404) [at=$(precise)]"
                break
                ;;
            *) log "delete failed: Runpod answered $code for pod $POD_ID; trying again in ${INTERVAL}s" ;;
        esac
        sleep "$INTERVAL"
    done
    while :; do sleep 3600; done
}

# -- the run directory, the keys, sshd ----------------------------------------

claim() {
    owner="run=$RUN_ID pod=$POD_ID"
    if (set -C; printf '%s\n' "$owner" > "$STATE/owner") 2>/dev/null; then
        log "claim: the run directory $RUN_DIR belongs to run $RUN_ID (pod $POD_ID)"
        if [ -n "${NODE_ADDR:-}" ]; then
            printf 'rank=%s addr=%s primary=%s nodes=%s\n' "${NODE_RANK:-0}" "$NODE_ADDR" \
                "${PRIMARY_ADDR:-}" "${NUM_NODES:-}" > "$STATE/node"
            log "cluster: node ${NODE_RANK:-0} of ${NUM_NODES:-?} at $NODE_ADDR (primary ${PRIMARY_ADDR:-?})"
        fi
        return
    fi
    found=$(cat "$STATE/owner" 2>/dev/null)
    if [ "$found" = "$owner" ]; then
        RESTARTED=1
        log "claim: the run directory $RUN_DIR is already this pod's (its container restarted)"
    else
        log "claim: the run directory $RUN_DIR belongs to another pod ($found): this pod starts no job, and is deleted at boot_grace"
    fi
}

install_keys() {
    chmod 700 "$SSH_DIR" 2>/dev/null
    if [ -n "$AUTHORIZED_KEY" ]; then
        printf '%s\n' "$AUTHORIZED_KEY" > "$SSH_DIR/authorized_keys" && chmod 600 "$SSH_DIR/authorized_keys"
        log "keys: the client's public key is in $SSH_DIR/authorized_keys"
    else
        log "keys: no OVERBRAINER_AUTHORIZED_KEY: nobody can log in"
    fi
    if [ -n "$HOST_KEY_B64" ] && printf '%s' "$HOST_KEY_B64" | base64 -d > "$HOST_KEY_FILE.tmp" 2>/dev/null \
        && [ -s "$HOST_KEY_FILE.tmp" ]; then
        chmod 600 "$HOST_KEY_FILE.tmp" && mv -f "$HOST_KEY_FILE.tmp" "$HOST_KEY_FILE"
        log "keys: the host key the client pinned is installed"
    else
        rm -f "$HOST_KEY_FILE.tmp"
        log "keys: no readable host key in OVERBRAINER_HOST_KEY: sshd cannot show the key the client pinned"
    fi
    HOST_KEY_B64=
}

start_sshd() {
    SSHD_STARTS=$((SSHD_STARTS + 1))
    if [ ! -x "$SSHD" ] && [ -z "$ROOT" ] && [ -z "${OVERBRAINER_SSHD:-}" ] && command -v apt-get >/dev/null 2>&1; then
        log "sshd: no $SSHD in the image: installing openssh-server"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null 2>&1 \
            || log "sshd: openssh-server could not be installed"
    fi
    [ -d /run/sshd ] || mkdir -p /run/sshd 2>/dev/null
    # HOME: the sessions' home is the pod's /root (under ROOT when simulated), never the host's
    cat > "$SSHD_CONFIG" <<EOF
Port $SSH_PORT
ListenAddress $SSH_ADDRESS
HostKey $HOST_KEY_FILE
PidFile $ETC/overbrainer_sshd.pid
AuthorizedKeysFile $SSH_DIR/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
ChallengeResponseAuthentication no
UsePAM no
PermitRootLogin prohibit-password
StrictModes no
Subsystem sftp internal-sftp
SetEnv OVERBRAINER_WORKSPACE=$WORKSPACE HOME=$ROOT/root
ClientAliveInterval 30
MaxStartups 100
MaxSessions 100
LogLevel VERBOSE
EOF
    if ! "$SSHD" -t -f "$SSHD_CONFIG" >> "$SSHD_LOG" 2>&1; then
        say "sshd: $SSHD refuses to start with $SSHD_CONFIG (see $SSHD_LOG): nobody can reach this pod"
        SSHD_PID=
        return 1
    fi
    "$SSHD" -D -e -f "$SSHD_CONFIG" < /dev/null >> "$SSHD_LOG" 2>&1 &
    SSHD_PID=$!
    log "sshd: started (pid $SSHD_PID) on $SSH_ADDRESS:$SSH_PORT"
}

# -- the bounds ---------------------------------------------------------------

RESTARTED=0
LOST_JOB=0
claim
# the job watched: the run's own, or the one a pipeline sharing the pod named last
JOB_DIR=$RUN_DIR
named_job() { named=$(cat "$STATE/job" 2>/dev/null) && [ -n "$named" ] && JOB_DIR=$named; }
named_job
if [ "$RESTARTED" = 1 ]; then
    # A container restarted (its host, Runpod's restart action) ends every process of
    # the pod: a job it ran without an exit code is lost, not running.
    now > "$STATE/restarted"
    if [ -e "$JOB_DIR/job.sh" ] && [ ! -e "$JOB_DIR/job.exit" ] && [ ! -e "$JOB_DIR/job.cancelled" ]; then
        LOST_JOB=1
        log "container: restarted; the job it ran was lost with it (job.sh, no exit code): $JOB_DIR"
    else
        log "container: restarted"
    fi
fi
BOOTED_FILE=$STATE/booted
if [ -s "$BOOTED_FILE" ]; then
    START=$(cat "$BOOTED_FILE")
else
    START=$(now)
    case $CREATED in
        '' | *[!0-9]*) ;;
        *) [ "$CREATED" -lt "$START" ] && START=$CREATED ;;
    esac
    printf '%s\n' "$START" > "$BOOTED_FILE"
fi
DEADLINE=$((START + $(awk -v h="$MAX_HOURS" 'BEGIN { printf "%d", h * 3600 }')))
BOOT_DEADLINE=$((START + BOOT_GRACE))
log "bootstrap: pod $POD_ID of run $RUN_ID, created at $(iso "$START"): max_hours $MAX_HOURS (deadline $(iso "$DEADLINE")), boot_grace ${BOOT_GRACE}s, retrieve_grace ${RETRIEVE_GRACE}s, lease_ttl ${LEASE_TTL}s, next_job_grace ${NEXT_GRACE}s, keep_pod $KEEP"

install_keys
start_sshd
check_api

ARMED_CAP=
COST_DEADLINE=none
COST_LEAD=0
RATE=
MAX_COST=none

# arm: reads the cost cap the client wrote (`rate=<usd/h> max_cost_usd=<usd|none>`)
# and confirms it in the log, with both deadlines; the client waits for that line.
arm() {
    cap=$(cat "$STATE/cap" 2>/dev/null) || return 0
    [ "$cap" = "$ARMED_CAP" ] && return 0
    if [ "$API_OK" != 1 ] && ! check_api; then
        log "cannot arm the cost cap: the Runpod API does not answer, so this pod could not delete itself"
        return 0
    fi
    RATE=
    MAX_COST=none
    for word in $cap; do
        case $word in
            rate=*) RATE=${word#rate=} ;;
            max_cost_usd=*) MAX_COST=${word#max_cost_usd=} ;;
        esac
    done
    ARMED_CAP=$cap
    if [ "$KEEP" = 1 ]; then
        COST_DEADLINE=none
        log "cost cap armed: keep_pod is on, so nothing deletes this pod once its job started (\$$RATE/h) [deadline_unix=none cost_deadline_unix=none]"
        return 0
    fi
    if [ "$MAX_COST" = none ]; then
        COST_DEADLINE=none
        log "cost cap armed: no max_cost_usd; max_hours deletes the pod at $(iso "$DEADLINE") (\$$RATE/h) [deadline_unix=$DEADLINE cost_deadline_unix=none]"
        return 0
    fi
    seconds=$(awk -v c="$MAX_COST" -v r="$RATE" -v m=$((INTERVAL + DELETE_MARGIN)) \
        'BEGIN { if (r + 0 <= 0) print -1; else { s = c / r * 3600 - m; printf "%d", (s < 0 ? 0 : s) } }')
    if [ "$seconds" -lt 0 ]; then
        ARMED_CAP=
        log "cannot arm the cost cap: the pod's rate ($RATE) is not a positive number of dollars an hour"
        return 0
    fi
    COST_DEADLINE=$((START + seconds))
    COST_LEAD=$((seconds / 10))   # the checkpoint is asked a tenth of the budget early, at most LEAD
    [ "$COST_LEAD" -gt "$LEAD" ] && COST_LEAD=$LEAD
    log "cost cap armed: max_cost_usd \$$MAX_COST at \$$RATE/h (GPUs and container disk) is reached at $(iso "$COST_DEADLINE") (one look and a delete early); max_hours deletes the pod at $(iso "$DEADLINE") [deadline_unix=$DEADLINE cost_deadline_unix=$COST_DEADLINE]"
}

# ask_checkpoint WHY: asks a running job for a resumable checkpoint and a stop.
ask_checkpoint() {
    : > "$JOB_DIR/stop.request" 2>/dev/null
    log "decision: asked the job for a checkpoint (stop.request): $1"
}

# nap: sleeps one look's interval; while the cost cap is not armed, looks every second for a
# new cap the client wrote and waits for (no job starts before it: the pod bills that wait)
NAP_CAP=
nap() {
    if [ -n "$ARMED_CAP" ]; then
        sleep "$INTERVAL"
        return
    fi
    slept=0
    while [ "$slept" -lt "$INTERVAL" ]; do
        written=$(cat "$STATE/cap" 2>/dev/null)
        if [ -n "$written" ] && [ "$written" != "$NAP_CAP" ]; then
            NAP_CAP=$written
            return
        fi
        sleep 1
        slept=$((slept + 1))
    done
}

JOB_SEEN=0
ANY_JOB=0
JOBS=1
WATCHED=$JOB_DIR
ENDED_AT=
ASKED_HOURS=0
ASKED_COST=0
HOLD_NOTED=0
LEASE_NOTED=
BETWEEN_NOTED=

while :; do
    t=$(now)
    : > "$STATE/alive"
    if [ -n "$SSHD_PID" ] && ! kill -0 "$SSHD_PID" 2>/dev/null && [ "$SSHD_STARTS" -lt "$MAX_SSHD_STARTS" ]; then
        log "sshd: pid $SSHD_PID exited; starting it again"
        start_sshd
    fi
    if [ "$API_OK" != 1 ] && [ $((t - API_CHECKED)) -ge 60 ]; then
        check_api
    fi
    arm

    named_job
    if [ "$JOB_DIR" != "$WATCHED" ]; then
        # the pipeline sharing the pod named its next job: its bounds start afresh
        WATCHED=$JOB_DIR
        JOBS=$((JOBS + 1))
        JOB_SEEN=0
        ENDED_AT=
        ASKED_HOURS=0
        ASKED_COST=0
        HOLD_NOTED=0
        LOST_JOB=0
        log "job: the pipeline's job $JOBS on this pod is in $JOB_DIR"
    fi
    running=0
    if [ -e "$JOB_DIR/job.sh" ]; then
        if [ "$JOB_SEEN" != 1 ]; then
            JOB_SEEN=1
            ANY_JOB=1
            log "job: started (job.sh is there)"
        fi
        if [ -z "$ENDED_AT" ]; then
            how=
            if [ -e "$JOB_DIR/job.exit" ]; then
                how="exit code $(cat "$JOB_DIR/job.exit" 2>/dev/null)"
            elif [ -e "$JOB_DIR/job.cancelled" ]; then
                how="cancelled"
            elif [ "$LOST_JOB" = 1 ]; then
                how="lost: the container restarted"
            fi
            if [ -n "$how" ]; then
                ENDED_AT=$t
                if [ "$KEEP" = 1 ]; then
                    log "job: ended ($how); keep_pod is on: the pod stays"
                else
                    log "job: ended ($how); unless its files are retrieved, the pod is deleted at $(iso $((t + RETRIEVE_GRACE))) (retrieve_grace ${RETRIEVE_GRACE}s)"
                fi
            else
                running=1
            fi
        fi
    fi

    # after the job's own state, so that the log tells how it ended before the delete
    if [ "$KEEP" != 1 ] && [ -e "$STATE/retrieved" ]; then
        delete_pod "the client retrieved and verified the run's files (.pod/retrieved)"
    fi

    if [ "$ANY_JOB" != 1 ] && [ "$t" -ge "$BOOT_DEADLINE" ]; then
        delete_pod "no job started within boot_grace (${BOOT_GRACE}s after the pod was created)"
    fi

    if [ "$KEEP" != 1 ]; then
        # between two jobs of a pipeline: the last job's files were verified (the marker names
        # the job watched) or the job named next has not started; no next job, no pod
        if [ "$running" != 1 ] && [ -e "$STATE/between" ]; then
            verified=$(cat "$STATE/between" 2>/dev/null)
            if [ "$verified" = "$JOB_DIR" ] || [ ! -e "$JOB_DIR/job.sh" ]; then
                since=$(mtime "$STATE/between")
                if [ "$BETWEEN_NOTED" != "$since" ]; then
                    BETWEEN_NOTED=$since
                    log "between jobs: the files of $verified were verified; unless the pipeline's next job starts, the pod is deleted at $(iso $((since + NEXT_GRACE))) (next_job_grace ${NEXT_GRACE}s)"
                fi
                if [ "$t" -ge $((since + NEXT_GRACE)) ]; then
                    delete_pod "no next job of the pipeline started within next_job_grace (${NEXT_GRACE}s after the files of its last job were verified)"
                fi
            fi
        fi

        if [ -n "$ENDED_AT" ] && [ "$t" -ge $((ENDED_AT + RETRIEVE_GRACE)) ]; then
            delete_pod "the job ended ${RETRIEVE_GRACE}s ago and its files were not retrieved (retrieve_grace)"
        fi

        leased=0
        if [ -e "$STATE/lease" ]; then
            renewed=$(mtime "$STATE/lease")
            [ $((t - renewed)) -lt "$LEASE_TTL" ] && leased=1
        fi
        if [ "$t" -ge $((DEADLINE - LEAD)) ]; then
            if [ "$leased" = 1 ]; then
                if [ "$t" -ge "$DEADLINE" ] && [ "$LEASE_NOTED" != "$renewed" ]; then
                    LEASE_NOTED=$renewed
                    log "lease: max_hours passed ($(iso "$DEADLINE")), but a client following the job renewed the lease at $(iso "$renewed"): the pod stays until $(iso $((renewed + LEASE_TTL))) unless it is renewed again"
                fi
            else
                if [ "$running" = 1 ] && [ "$ASKED_HOURS" != 1 ]; then
                    ASKED_HOURS=1
                    ask_checkpoint "max_hours ends at $(iso "$DEADLINE") and no lease holds it off"
                fi
                if [ "$t" -ge "$DEADLINE" ] && [ -n "$ENDED_AT" ] && [ "$ASKED_HOURS" = 1 ]; then
                    # the job saved what it was asked for: keep it retrievable, for a bounded time
                    until=$((ENDED_AT + HOLD))
                    [ "$until" -gt $((DEADLINE + HOLD)) ] && until=$((DEADLINE + HOLD))
                    if [ "$HOLD_NOTED" != 1 ]; then
                        HOLD_NOTED=1
                        log "hold: max_hours passed ($(iso "$DEADLINE")), but the job ended after it was asked for a checkpoint: the pod stays until $(iso "$until") (checkpoint_hold ${HOLD}s) for its files to be retrieved"
                    fi
                    if [ "$t" -ge "$until" ]; then
                        delete_pod "max_hours reached ($MAX_HOURS h, at $(iso "$DEADLINE")); the job ended after it was asked for a checkpoint, and its files were not retrieved within checkpoint_hold (${HOLD}s)"
                    fi
                elif [ "$t" -ge "$DEADLINE" ]; then
                    delete_pod "max_hours reached ($MAX_HOURS h, at $(iso "$DEADLINE")) and no lease was renewed in the last ${LEASE_TTL}s"
                fi
            fi
        fi

        # A hard cap: no lease holds it off; the job is asked for a checkpoint before it,
        # as before max_hours, so that a follower retrieves what it saved.
        if [ "$COST_DEADLINE" != none ] && [ "$running" = 1 ] && [ "$ASKED_COST" != 1 ] \
            && [ "$t" -ge $((COST_DEADLINE - COST_LEAD)) ]; then
            ASKED_COST=1
            ask_checkpoint "max_cost_usd (\$$MAX_COST at \$$RATE/h) is reached at $(iso "$COST_DEADLINE")"
        fi
        if [ "$COST_DEADLINE" != none ] && [ "$t" -ge "$COST_DEADLINE" ]; then
            delete_pod "max_cost_usd reached: \$$MAX_COST at \$$RATE/h since $(iso "$START")"
        fi
    fi
    nap
done
