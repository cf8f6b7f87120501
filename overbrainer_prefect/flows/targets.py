"""Finding the target block a flow names, and the messages when there is none."""

from __future__ import annotations

from pydantic import ValidationError

from overbrainer_prefect.blocks import LocalTarget, RunpodTarget, SshTarget, TargetBlock
from overbrainer_prefect.runpod.settings import one_line
from overbrainer_prefect.targets.base import Logger, Target

TARGET_TYPES: tuple[type[TargetBlock], ...] = (LocalTarget, SshTarget, RunpodTarget)
"""The target block types, in the order a bare name is looked up."""


class UnknownTarget(ValueError):
    """No target block has the name a flow was given."""


class AmbiguousTarget(ValueError):
    """A bare name that blocks of two target types share: the message names both."""


async def load_target(name: str) -> tuple[str, TargetBlock]:
    """The target block `name` (`<block-type-slug>/<name>` or a bare block name,
    looked up in each target type) and its qualified reference.

    Raises UnknownTarget with one line saying how to create it, and
    AmbiguousTarget, naming each, when a bare name is saved in two target types.
    """
    slug, sep, bare = name.rpartition("/")
    types = [t for t in TARGET_TYPES if not sep or t.get_block_type_slug() == slug]
    if sep and not types:
        known = ", ".join(t.get_block_type_slug() for t in TARGET_TYPES)
        raise UnknownTarget(f"{slug!r} is not a target block type: use one of {known}")
    found: list[tuple[type[TargetBlock], TargetBlock]] = []
    for block_type in types:
        try:
            found.append((block_type, await block_type.aload(bare)))
        except ValidationError as error:
            raise UnknownTarget(
                f"the {block_type.get_block_type_name()} block {bare!r} holds a setting that is "
                f"not valid ({one_line(error)}): fix it in the Prefect UI under Blocks"
            ) from None
        except ValueError:
            continue
    if len(found) > 1:
        refs = " and ".join(f"{t.get_block_type_slug()}/{bare}" for t, _ in found)
        raise AmbiguousTarget(
            f"{len(found)} target blocks are named {bare!r} ({refs}): name the one to use "
            f"with its type, like {found[0][0].get_block_type_slug()}/{bare}, or save one "
            "under another name"
        )
    if found:
        block_type, block = found[0]
        return f"{block_type.get_block_type_slug()}/{bare}", block
    kinds = " or ".join(f"'{t.get_block_type_name()}'" for t in types)
    raise UnknownTarget(
        f"no target block named {bare!r} ({kinds}): create it with "
        f"`python blocks/create_blocks.py` or in the Prefect UI under Blocks"
    )


async def target_named(name: str, log: Logger) -> Target:
    """The `Target` of the block `name` (see `load_target`), logging to `log`.
    Raises UnknownTarget, or SettingsError for settings that cannot be used,
    each with one line."""
    ref, block = await load_target(name)
    return block.target(ref, log)
