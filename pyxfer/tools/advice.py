"""What to check next, by the path a pair's copies take and what went wrong: `pyxfer doctor` attaches these
lines to every pair whose verdict is not ``ok`` (and to one whose link error counters rose), in the report
and in the JSON. The path of a pair (the doctor's ``path`` field):

  nvlink   GPU pair with peer access over NVLink (NVML says so)
  pcie     GPU pair with peer access over PCIe
  peer     GPU pair with peer access, the link's kind unknown (no NVML: pip install 'pyxfer[nvml]')
  none     GPU pair without peer access: copies go through the host (staged)
  local    one GPU's memory to itself
  host     host memory <-> a GPU
  memory   host memory -> host memory (a machine without GPUs)
"""

__all__ = ["PATHS", "PROBLEMS", "advice"]

PATHS = ("nvlink", "pcie", "peer", "none", "local", "host", "memory")
PROBLEMS = ("fault", "hung", "error", "slow", "unsupported", "p2p-slower-than-staged", "link-errors")

_XID = "dmesg | grep -i xid: an Xid names the GPU's fault (74: NVLink error; 79: fallen off the bus; 48, 63, 94: ECC)"
_ENV = ('until it is fixed: eval "$(pyxfer doctor --env)" keeps NCCL and other software off broken pairs; '
        "pyxfer itself routes them staged (PYXFER_HEALTH_FROM_DOCTOR=1)")
_NVLINK = ["nvidia-smi topo -m and nvidia-smi topo -p2p n: the pair should read NV<n> and OK",
           "nvidia-smi nvlink --status -i <gpu>: every link up at its full rate; nvidia-smi nvlink -e -i <gpu>: "
           "CRC / replay / recovery error counts",
           "NVSwitch systems (HGX / DGX): systemctl status nvidia-fabricmanager (running, same version as the driver)"]
_PCIE = ["ACS on the PCIe switches / root ports between the GPUs sends peer traffic to the root complex, where it "
         "can fail or corrupt: sudo lspci -vvv | grep ACSCtl (NCCL's guidance: disable ACS for peer-to-peer)",
         "IOMMU: cat /proc/cmdline (intel_iommu= / amd_iommu= / iommu=pt): peer DMA through a translating IOMMU "
         "can fail",
         "BAR1: nvidia-smi -q -d MEMORY (BAR1 Memory Usage): a BAR1 smaller than the GPU's memory cannot map "
         "a peer's buffers",
         "in a VM: the hypervisor must pass peer-to-peer through (nvidia-smi topo -p2p r)"]
_HOST = ["locked memory: ulimit -l (pinned buffers), and the IOMMU: cat /proc/cmdline",
         "nvidia-smi -q -d PCIE: link generation / width against the maximum, replay count"]
_CLOCKS = ("nvidia-smi -q -d PERFORMANCE,CLOCK: power or thermal throttling, clocks below the application clocks "
           "(lock them for a measurement: sudo nvidia-smi -lgc <MHz>)")
_BUSY = "nvidia-smi: other processes copying on these GPUs at the same time"
_NUMA = "nvidia-smi topo -m: the GPU's CPU / NUMA affinity: run host copies near it (numactl --cpunodebind)"

_TABLE = {
    ("nvlink", "fault"): _NVLINK + [_XID, _ENV],
    ("nvlink", "slow"): [_NVLINK[1], _CLOCKS, _BUSY],
    ("pcie", "fault"): _PCIE + [_XID, _ENV],
    ("pcie", "slow"): ["nvidia-smi --query-gpu=pcie.link.gen.max,pcie.link.width.max,pcie.link.gen.current,"
                       "pcie.link.width.current --format=csv (under load): a link trained below its rate",
                       "nvidia-smi topo -m: a pair across CPU sockets (SYS) goes over the inter-socket link",
                       _CLOCKS, _BUSY],
    ("peer", "fault"): [_NVLINK[0], _PCIE[0], _PCIE[1], _XID, _ENV,
                        "install nvidia-ml-py (pip install 'pyxfer[nvml]') for the link's kind and its counters"],
    ("peer", "slow"): [_NVLINK[0], _CLOCKS, _BUSY],
    ("none", "unsupported"): ["nvidia-smi topo -p2p r says why there is no peer access (CNS: chipset not "
                              "supported, ...); copies between these GPUs go through host memory (pyxfer stages "
                              "them; NCCL uses shared memory): expected on some PCIe machines, not on NVLink ones"],
    ("none", "fault"): _HOST + [_XID, _ENV],
    ("none", "slow"): [_NUMA, _CLOCKS, _BUSY],
    ("local", "fault"): ["GPU memory errors: nvidia-smi -q -d ECC,ROW_REMAPPER (uncorrectable errors, pending "
                         "row remaps: a reset applies them)", _XID],
    ("local", "slow"): [_CLOCKS, _BUSY],
    ("host", "fault"): _HOST + [_XID, _ENV],
    ("host", "slow"): [_HOST[1], _NUMA, _CLOCKS, _BUSY],
    ("memory", "fault"): ["memory errors: dmesg | grep -i -e mce -e edac; a memory test (memtester) of the host"],
    ("memory", "slow"): ["other processes on the host's cores; CPU frequency scaling (cpupower frequency-info)"],
    ("any", "hung"): [_XID, "nvidia-smi: a GPU of the pair at 100% with no process, or not answering: the GPU "
                            "needs a reset (nvidia-smi -r -i <gpu>, nothing running) or the node a reboot"],
    ("any", "error"): [_XID, "the evidence names the error; run the probe's copy alone in Python to see it whole"],
    ("any", "p2p-slower-than-staged"): [
        "direct peer copies lose to going through host memory: a PCIe path through the root complex or across "
        "sockets; NCCL_P2P_LEVEL=PXB (or NCCL_P2P_DISABLE=1) may serve NCCL better on this machine",
        _PCIE[0]],
    ("nvlink", "link-errors"): ["NVLink error counters rose during the probes: a marginal link (cable, "
                                "connector or switch tray); nvidia-smi nvlink -e -i <gpu>, and the vendor's "
                                "field diagnostics (dcgmi diag -r 3); health checks fail a node above 0"],
    ("any", "link-errors"): ["PCIe replays rose during the probes: a marginal slot, riser or cable; "
                             "nvidia-smi -q -d PCIE (Replays), dmesg | grep -i AER"],
}


def advice(path, problem):
    """[line]: what to check next for ``problem`` (one of PROBLEMS; "fault": a corrupt or dropped verdict)
    on a pair whose copies take ``path`` (one of PATHS). Every pair of the two has some."""
    if path not in PATHS:
        raise ValueError(f"advice: path must be one of {list(PATHS)}, got {path!r}")
    if problem not in PROBLEMS:
        raise ValueError(f"advice: problem must be one of {list(PROBLEMS)}, got {problem!r}")
    if problem == "unsupported" and path != "none":
        return ["the pair has no peer access: " + _TABLE[("none", "unsupported")][0]]
    return list(_TABLE.get((path, problem)) or _TABLE[("any", problem)])
