"""Creates the blocks a user of overbrainer-prefect needs, on the Prefect server
that PREFECT_API_URL (or the active profile) names.

Secrets come from the environment only, never from flags (flags are visible
to every user of the machine in the process list):

    HF_TOKEN        -> an Overbrainer Hugging Face Credentials block (--hf-name)
    RUNPOD_API_KEY  -> an Overbrainer Runpod Credentials block (--runpod-name),
                       and with --runpod-target NAME a Runpod target using it

Targets come from flags:

    --local-job-venv PATH                      -> a local target (--local-name)
    --ssh-host HOST --ssh-host-key KEY --job-venv PATH [--ssh-port --ssh-user
    --ssh-key-file --ssh-work-dir]             -> an SSH target (--ssh-name)

the GPU budget (global concurrency limits) from
`--budget-pods N --budget-dollars-per-hour X`, and the day's and month's
dollars (the `overbrainer_budget` variable) from `--budget-day-usd X
--budget-month-usd Y` (with `--budget-target NAME`, for that target alone).

It prints the name and type of each block it saves, never a secret:

    HF_TOKEN=hf_... python blocks/create_blocks.py --local-job-venv ~/venvs/axolotl
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from prefect.blocks.core import Block
from pydantic import SecretStr, ValidationError

from overbrainer_prefect import blocks
from overbrainer_prefect.money.budgets import BudgetSettingError, budgets_from
from overbrainer_prefect.server_budget import (
    BUDGET_VARIABLE,
    POD_LIMIT,
    SPEND_LIMIT,
    BudgetError,
    read_budgets,
    set_budget,
    set_budgets,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; exits with a one-line error for an incomplete target."""
    parser = argparse.ArgumentParser(
        description="Create the blocks of overbrainer-prefect (secrets from HF_TOKEN and "
        "RUNPOD_API_KEY in the environment, targets from flags).",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace blocks that exist")
    parser.add_argument("--hf-name", default="huggingface", help="name of the HF block")
    parser.add_argument("--runpod-name", default="runpod", help="name of the Runpod key block")
    parser.add_argument(
        "--runpod-target", metavar="NAME", help="also create a Runpod target block NAME"
    )
    local = parser.add_argument_group("local target")
    local.add_argument("--local-job-venv", metavar="PATH", help="the job venv on this machine")
    local.add_argument("--local-name", default="local")
    local.add_argument("--local-work-dir", default="~/.overbrainer/work")
    ssh = parser.add_argument_group("SSH target")
    ssh.add_argument("--ssh-host", metavar="HOST")
    ssh.add_argument("--ssh-port", type=int, default=22)
    ssh.add_argument("--ssh-user", default="root")
    ssh.add_argument("--ssh-key-file", metavar="PATH", help="the client's private key file")
    ssh.add_argument(
        "--ssh-host-key", metavar="KEY", help="the host's public key, as ssh-keyscan prints it"
    )
    ssh.add_argument("--ssh-work-dir", default="/root/overbrainer")
    ssh.add_argument("--job-venv", metavar="PATH", help="the job venv on the SSH host")
    ssh.add_argument("--ssh-name", default="gpu-box")
    budget = parser.add_argument_group("GPU budget")
    budget.add_argument("--budget-pods", type=int, metavar="N", help="pods at once, at most")
    budget.add_argument(
        "--budget-dollars-per-hour", type=float, metavar="X", help="their $/h together, at most"
    )
    money = parser.add_argument_group("day and month budgets (dollars, UTC days and months)")
    money.add_argument("--budget-day-usd", metavar="X", help="dollars a day, every pod together")
    money.add_argument("--budget-month-usd", metavar="Y", help="dollars a month, every pod")
    money.add_argument(
        "--budget-target",
        metavar="NAME",
        help="the day and month budgets are this target block's own (`<type>/<name>`)",
    )
    args = parser.parse_args(argv)
    args.money = args.budget_day_usd is not None or args.budget_month_usd is not None
    if args.money:
        try:  # checked before anything is saved
            budgets_from({"day_usd": args.budget_day_usd, "month_usd": args.budget_month_usd})
        except BudgetSettingError as error:
            parser.error(str(error))
    elif args.budget_target:
        parser.error("--budget-target needs --budget-day-usd or --budget-month-usd")
    if args.ssh_host:
        if not args.ssh_host_key:
            parser.error(
                f"--ssh-host-key is required with --ssh-host: pin the host's key (the line "
                f"`ssh-keyscan -p {args.ssh_port} {args.ssh_host}` prints, checked out of band)"
            )
        if not args.job_venv:
            parser.error("--job-venv is required with --ssh-host: the job venv on the host")
    if (args.budget_pods is None) != (args.budget_dollars_per_hour is None):
        parser.error("give --budget-pods and --budget-dollars-per-hour together")
    nothing = not (
        os.environ.get("HF_TOKEN")
        or os.environ.get("RUNPOD_API_KEY")
        or args.local_job_venv
        or args.ssh_host
        or args.budget_pods is not None
        or args.money
    )
    if nothing:
        parser.error(
            "nothing to create: set HF_TOKEN or RUNPOD_API_KEY, or give --local-job-venv, "
            "--ssh-host, --budget-pods or --budget-day-usd"
        )
    return args


async def save(block: Block, name: str, overwrite: bool) -> None:
    """Saves `block` as `name` and says so (its name and type only)."""
    await block.asave(name, overwrite=overwrite)
    print(f"saved {block.get_block_type_slug()}/{name}")


async def create(args: argparse.Namespace) -> None:
    """Creates the blocks and the budget the arguments and environment ask for."""
    hf: blocks.HuggingFaceCredentials | None = None
    if os.environ.get("HF_TOKEN"):
        hf = blocks.HuggingFaceCredentials(token=SecretStr(os.environ["HF_TOKEN"]))
        await save(hf, args.hf_name, args.overwrite)
    if os.environ.get("RUNPOD_API_KEY"):
        credentials = blocks.RunpodCredentials(api_key=SecretStr(os.environ["RUNPOD_API_KEY"]))
        await save(credentials, args.runpod_name, args.overwrite)
        if args.runpod_target:
            runpod: Any = blocks.RunpodTarget(credentials=credentials, huggingface=hf)
            await save(runpod, args.runpod_target, args.overwrite)
    elif args.runpod_target:
        raise SystemExit("--runpod-target needs RUNPOD_API_KEY in the environment")
    if args.local_job_venv:
        local = blocks.LocalTarget(
            job_venv=args.local_job_venv, work_dir=args.local_work_dir, huggingface=hf
        )
        await save(local, args.local_name, args.overwrite)
    if args.ssh_host:
        target = blocks.SshTarget(
            host=args.ssh_host,
            port=args.ssh_port,
            user=args.ssh_user,
            key_file=args.ssh_key_file,
            host_key=args.ssh_host_key,
            work_dir=args.ssh_work_dir,
            job_venv=args.job_venv,
            huggingface=hf,
        )
        await save(target, args.ssh_name, args.overwrite)
    if args.budget_pods is not None:
        sizes = await set_budget(args.budget_pods, args.budget_dollars_per_hour)
        print(
            f"GPU budget: {POD_LIMIT} = {sizes[POD_LIMIT]} pods, "
            f"{SPEND_LIMIT} = {sizes[SPEND_LIMIT]} cents/h"
        )
    if args.money:
        await save_money(args.budget_day_usd, args.budget_month_usd, args.budget_target)


async def save_money(day: str | None, month: str | None, target: str | None) -> None:
    """Saves the day's and month's budgets (every target's, or `target`'s own,
    keeping the others) and says what they are."""
    saved = await read_budgets()
    limits = {"day_usd": day, "month_usd": month}
    if target is None:
        kept = saved.targets if saved is not None else {}
        budgets = await set_budgets(day, month, {k: v.model_dump() for k, v in kept.items()})
    else:
        targets = {k: v.model_dump() for k, v in (saved.targets if saved else {}).items()}
        targets[target] = limits
        budgets = await set_budgets(
            saved.day_usd if saved else None, saved.month_usd if saved else None, targets
        )
    print(f"budget: {BUDGET_VARIABLE} = {budgets.model_dump_json(exclude_none=True)}")


def main(argv: list[str] | None = None) -> int:
    """Runs the script; returns its exit status. Errors are one line, without
    any secret (a block that exists says to pass --overwrite)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        asyncio.run(create(args))
    except ValidationError as error:  # never the input values: they may be secrets
        problem = error.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(part) for part in problem["loc"])
        print(f"create_blocks: {error.title} {where}: {problem['msg']}", file=sys.stderr)
        return 1
    except (ValueError, BudgetError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "already exists" in first or "overwrite" in first:
            first += " (pass --overwrite to replace it)"
        print(f"create_blocks: {first}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
