"""The Prefect artifacts of one flow run, read through the API, for the flow tests."""

import asyncio


def run_artifacts(key: str, state) -> list:
    """The artifacts `key` of the flow run that ended in `state`, never another test's;
    asserts there is at least one."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    run_id = state.state_details.flow_run_id
    assert run_id is not None

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=[key]),
                    flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]),
                )
            )

    found = asyncio.run(read())
    assert found, f"no {key} artifact in flow run {run_id}"
    return found
