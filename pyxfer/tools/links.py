"""What NVML says about the links between GPUs and to the host, for `pyxfer doctor`: the kind of each GPU
pair's path (NVLink or PCIe), each GPU's PCIe generation and width, and the link error counters (NVLink CRC /
replay / recovery, PCIe replay) read before and after the probes.

NVML comes from the optional nvidia-ml-py package (pip install 'pyxfer[nvml]'). Every function here raises
nothing: without the package, without a driver or where a GPU does not report a counter, the answer says
so (``why``) and the doctor goes on without it. GPUs are found by UUID, so CUDA_VISIBLE_DEVICES's renumbering
and NVML's own order do not matter.
"""
import contextlib

__all__ = ["COUNTERS", "nvml_facts", "read_counters", "counter_rises"]

# counter name -> NVML field (totals over a GPU's links; the per-link error API is deprecated on Hopper)
COUNTERS = {"nvlink_crc_flit": "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
            "nvlink_crc_data": "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
            "nvlink_replay": "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
            "nvlink_recovery": "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
            "pcie_replay": "NVML_FI_DEV_PCIE_REPLAY_COUNTER"}


@contextlib.contextmanager
def _nvml():
    """pynvml, initialized (shut down after); raises RuntimeError saying why NVML cannot be used."""
    try:
        import pynvml
    except ImportError:
        raise RuntimeError("NVML unavailable: nvidia-ml-py is not installed (pip install 'pyxfer[nvml]')") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise RuntimeError(f"NVML unavailable: {e}") from None
    try:
        yield pynvml
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _why(e):
    return str(e) if isinstance(e, RuntimeError) else f"NVML: {type(e).__name__}: {e}"


def _value(v):
    """A field value as a Python number, by its NVML value type."""
    members = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by NVML_VALUE_TYPE_*
    kind = int(v.valueType)
    return getattr(v.value, members[kind] if kind < len(members) else "ullVal")


def _handles(nvml, uuids):
    return [nvml.nvmlDeviceGetHandleByUUID(u) for u in uuids]


def nvml_facts(uuids):
    """{"available", "why", "links": {(i, j): "nvlink" | "pcie"}, "pcie": {i: {"gen", "width"}}} for the GPUs
    with these UUIDs (by position in ``uuids``): the kind of peer path of every ordered pair with peer
    access through NVLink or PCIe as NVML reports it, and each GPU's maximum PCIe generation and width (the
    link's capability: an idle link trains down, so its current figures say little)."""
    facts = {"available": False, "why": None, "links": {}, "pcie": {}}
    try:
        with _nvml() as nvml:
            handles = _handles(nvml, uuids)
            for i, a in enumerate(handles):
                with contextlib.suppress(nvml.NVMLError):
                    facts["pcie"][i] = {"gen": nvml.nvmlDeviceGetMaxPcieLinkGeneration(a),
                                        "width": nvml.nvmlDeviceGetMaxPcieLinkWidth(a)}
                for j, b in enumerate(handles):
                    if i == j:
                        continue
                    with contextlib.suppress(nvml.NVMLError):
                        nvlink = nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
                        facts["links"][(i, j)] = "nvlink" if nvlink == nvml.NVML_P2P_STATUS_OK else "pcie"
            facts["available"] = True
    except Exception as e:  # noqa: BLE001  (NVML errors of any kind: these facts are optional)
        facts["why"] = _why(e)
    return facts


def read_counters(uuids):
    """{"available", "why", "gpus": {i: {counter: int}}}: the COUNTERS each GPU reports now (a counter the
    GPU does not report is left out of its dict)."""
    out = {"available": False, "why": None, "gpus": {}}
    try:
        with _nvml() as nvml:
            names = [n for n in COUNTERS if hasattr(nvml, COUNTERS[n])]
            fields = [getattr(nvml, COUNTERS[n]) for n in names]
            for i, h in enumerate(_handles(nvml, uuids)):
                values = nvml.nvmlDeviceGetFieldValues(h, fields)
                out["gpus"][i] = {n: int(_value(v)) for n, v in zip(names, values)
                                  if v.nvmlReturn == nvml.NVML_SUCCESS}
            out["available"] = True
    except Exception as e:  # noqa: BLE001
        out["why"] = _why(e)
    return out


def counter_rises(before, after):
    """{i: {counter: rise}} of the counters that rose between two read_counters() results (only GPUs and
    counters present in both)."""
    rises = {}
    for i, now in after.get("gpus", {}).items():
        then = before.get("gpus", {}).get(i, {})
        up = {n: now[n] - then[n] for n in now if n in then and now[n] > then[n]}
        if up:
            rises[i] = up
    return rises
