"""Prefect's standard checks for blocks (`BlockStandardTestSuite`, as Prefect's
own integrations run it) over every block type this package registers: a
description, a documentation URL, a description ending in a period on every
field, a code example that imports and loads the block, and a square logo."""

from __future__ import annotations

import struct

import pytest
from prefect.blocks.core import Block
from prefect.testing.standard_test_suites import BlockStandardTestSuite
from prefect.utilities.dispatch import get_registry_for_type
from prefect.utilities.importtools import to_qualified_name
from pydantic.json_schema import GenerateJsonSchema

import overbrainer_prefect.blocks
from overbrainer_prefect.blocks import LOGO_FILE, LOGO_URL
from tests.conftest import REPO


def package_blocks() -> list[type[Block]]:
    """The block types this package registers (its entry point imports
    `overbrainer_prefect.blocks`), abstract bases left out, by slug."""
    assert overbrainer_prefect.blocks  # imported: its blocks are registered
    registry = get_registry_for_type(Block) or {}
    return sorted(
        (
            block
            for block in registry.values()
            if to_qualified_name(block).startswith("overbrainer_prefect.")
            and not getattr(block, "__abstractmethods__", None)
        ),
        key=lambda block: block.get_block_type_slug(),
    )


def test_every_block_type_of_the_package_is_checked() -> None:
    names = {block.__name__ for block in package_blocks()}
    assert names == {
        "HuggingFaceCredentials",
        "LocalTarget",
        "OllamaServer",
        "RunpodCredentials",
        "RunpodTarget",
        "SshPool",
        "SshTarget",
    }


@pytest.mark.parametrize("block", package_blocks(), ids=lambda block: block.__name__)
class TestAllBlocksAdhereToStandards(BlockStandardTestSuite):
    @pytest.fixture
    def block(self, block: type[Block]) -> type[Block]:
        return block

    def test_has_a_valid_image(self, block: type[Block]) -> None:
        """The suite's own check fetches the logo from its URL; the tests reach no
        network, so the file that URL serves is checked here: a square PNG 45 to
        1000 px wide (read from its IHDR header, without Pillow)."""
        assert block._logo_url is not None and str(block._logo_url) == LOGO_URL
        assert LOGO_URL.endswith("/" + LOGO_FILE)
        png = (REPO / LOGO_FILE).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
        width, height = struct.unpack(">II", png[16:24])
        assert width == height and 1000 > width > 45, (width, height)


@pytest.mark.parametrize("block", package_blocks(), ids=lambda block: block.__name__)
def test_a_blocks_json_schema_is_prefects_made_once_and_each_caller_gets_its_own_copy(
    block: type[Block],
) -> None:
    """`Branded.model_json_schema` keeps Prefect's schema per class (Prefect asks
    for it once per field on every save): the same as Prefect's own, made once,
    and a caller that changes what it got changes nothing for the next."""
    from overbrainer_prefect.blocks import _BLOCK_SCHEMAS

    prefects = Block.model_json_schema.__func__(block)  # Prefect's own, uncached
    first = block.model_json_schema()
    assert first == prefects and "secret_fields" in first
    assert (
        block,
        True,
        "#/definitions/{model}",
        GenerateJsonSchema,
        "validation",
    ) in _BLOCK_SCHEMAS
    made = len(_BLOCK_SCHEMAS)
    first["properties"].clear()
    first["secret_fields"].append("changed")
    assert block.model_json_schema() == prefects
    assert block.model_json_schema(by_alias=False) == Block.model_json_schema.__func__(
        block, by_alias=False
    )
    block.model_json_schema()
    block.model_json_schema(by_alias=False)
    assert len(_BLOCK_SCHEMAS) - made <= 1  # by_alias=False's, unless a save made it before
    with pytest.raises(TypeError, match="no union_format 'primitive_type_array'"):
        block.model_json_schema(union_format="primitive_type_array")
