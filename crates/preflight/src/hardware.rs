//! What good looks like for a rank's GPU: its health (ECC, retired pages, slowdowns, MIG), the
//! links the hardware has (NVLink links up and their
//! speed, PCIe generation and width against their maximum, read through NVML, which is loaded at
//! run time like CUDA so nrun runs without a driver), the line rate they give, and the path NCCL
//! actually took (its own INFO log, written to a file for the preflight's ranks only).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A GPU's links, as NVML reports them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Links {
    /// NVLink links that are up, and each one's data rate per direction (GB/s).
    pub nvlink_up: u32,
    pub nvlink_gbs: f64,
    /// NVML's NVLink version of the links (see `nvlink_gbs`), 0 when none is up.
    #[serde(default)]
    pub nvlink_version: u32,
    /// PCIe generation and width now, and the most the GPU supports.
    pub pcie_gen: u32,
    pub pcie_width: u32,
    pub pcie_max_gen: u32,
    pub pcie_max_width: u32,
}

/// Data rate of one NVLink link per direction, by NVML's `nvmlNvlinkVersion_t`: 1 is NVLink
/// 1.0 (P100), 2 and 3 are 2.0/2.2 (V100), 4 and 5 are 3.0/3.1 (A100), 6 is 4.0 (H100, H200),
/// 7 is 5.0 (B200). Only 5.0 doubled the per-link rate.
fn nvlink_gbs(version: u32) -> f64 {
    match version {
        0 | 1 => 20.0,
        2..=6 => 25.0,
        _ => 50.0,
    }
}

/// PCIe data rate per direction (GB/s): per-lane rate after encoding, times lanes.
pub(crate) fn pcie_gbs(generation: u32, width: u32) -> f64 {
    let lane = match generation {
        1 => 0.25,
        2 => 0.5,
        3 => 0.985,
        4 => 1.969,
        5 => 3.938,
        _ => 7.563,
    };
    lane * f64::from(width)
}

impl Links {
    /// The line rate between this GPU and the others of its node: NVLink when links are up,
    /// else PCIe; with a few words saying which.
    pub fn line_rate(&self) -> (f64, String) {
        if self.nvlink_up > 0 {
            let r = f64::from(self.nvlink_up) * self.nvlink_gbs;
            (
                r,
                format!(
                    "NVLink {} links x {:.0} GB/s = {r:.0} GB/s",
                    self.nvlink_up, self.nvlink_gbs
                ),
            )
        } else {
            let r = pcie_gbs(self.pcie_gen, self.pcie_width);
            (
                r,
                format!(
                    "PCIe Gen{} x{} = {r:.0} GB/s",
                    self.pcie_gen, self.pcie_width
                ),
            )
        }
    }

    /// The PCIe link runs below what the GPU supports (a slot or riser trained down).
    pub(crate) fn pcie_degraded(&self) -> bool {
        self.pcie_max_gen > 0
            && (self.pcie_gen < self.pcie_max_gen || self.pcie_width < self.pcie_max_width)
    }
}

/// A device-to-device copy under this fraction of the GPU model's memory bandwidth is slow.
pub(crate) const MEMORY_FLOOR: f64 = 0.5;

/// The memory bandwidth (GB/s) of the GPU model named in `gpu` ("NVIDIA H200 (bus)"), with
/// the model's short name; None for a model not in the table.
pub(crate) fn memory_gbs(gpu: &str) -> Option<(f64, &'static str)> {
    const MODELS: [(&str, f64); 8] = [
        ("H200", 4800.0),
        ("H100 NVL", 3900.0),
        ("H100", 3350.0),
        ("B200", 8000.0),
        ("A100-SXM4-80GB", 2039.0),
        ("A100 80GB PCIe", 1935.0),
        ("A100", 1555.0),
        ("L40S", 864.0),
    ];
    MODELS
        .iter()
        .find(|(name, _)| gpu.contains(name))
        .map(|(name, gbs)| (*gbs, *name))
}

/// A GPU's health, as NVML reports it (None: not supported or not readable).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Health {
    pub temperature_c: Option<u32>,
    pub persistence: Option<bool>,
    /// Uncorrectable ECC errors since the driver loaded.
    pub ecc_uncorrected: Option<u64>,
    /// Memory pages waiting to be retired (older GPUs; newer ones remap rows).
    pub pages_pending_retirement: Option<bool>,
    /// Clock slowdowns now in effect that make a job crawl (not the normal power cap).
    pub slowdowns: Vec<String>,
    pub mig: Option<bool>,
    /// Rows of memory waiting to be remapped (A100 and later), and whether a remap failed.
    #[serde(default)]
    pub remap_pending: Option<bool>,
    #[serde(default)]
    pub remap_failed: Option<bool>,
    /// NVLink replay, recovery and CRC errors of the links that are up, since the driver
    /// loaded: shown, not judged (a count without a rate does not tell a bad link).
    #[serde(default)]
    pub nvlink_errors: Option<u64>,
}

/// A GPU health check that fails the preflight, by the name `--waive` takes: the one list both
/// the flag's parsing and the checks read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Waiver {
    /// Uncorrectable ECC errors.
    Ecc,
    /// Pages pending retirement.
    Retired,
    /// Rows pending remap, or a failed remap.
    Remap,
    /// Clocks slowed down.
    Throttle,
    /// MIG mode on.
    Mig,
}

impl Waiver {
    pub const ALL: [Waiver; 5] = [
        Waiver::Ecc,
        Waiver::Retired,
        Waiver::Remap,
        Waiver::Throttle,
        Waiver::Mig,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Waiver::Ecc => "ecc",
            Waiver::Retired => "retired",
            Waiver::Remap => "remap",
            Waiver::Throttle => "throttle",
            Waiver::Mig => "mig",
        }
    }
}

impl std::fmt::Display for Waiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Waiver {
    type Err = nrun_base::error::Error;

    /// One name as `--waive` takes it ("ecc"); the error names them all.
    fn from_str(w: &str) -> Result<Waiver, Self::Err> {
        Waiver::ALL
            .into_iter()
            .find(|x| x.name() == w)
            .ok_or_else(|| {
                let names: Vec<&str> = Waiver::ALL.iter().map(|x| x.name()).collect();
                let (last, rest) = names.split_last().unwrap_or((&"", &[]));
                nrun_base::error::Error::usage(format!(
                    "--waive {w:?}: expected {} or {last}",
                    rest.join(", ")
                ))
            })
    }
}

/// Something wrong with a GPU, with the check that found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unhealthy {
    pub check: Waiver,
    pub what: String,
    /// Slows a job down rather than failing it.
    pub slows: bool,
}

impl Health {
    /// What is wrong with the GPU, each with its check's name.
    pub fn problems(&self) -> Vec<Unhealthy> {
        let mut v = Vec::new();
        if let Some(n) = self.ecc_uncorrected.filter(|n| *n > 0) {
            v.push(Unhealthy {
                check: Waiver::Ecc,
                what: format!("{n} uncorrectable ECC errors since the driver loaded: drain the node and reset the GPU"),
                slows: false,
            });
        }
        if self.pages_pending_retirement == Some(true) {
            v.push(Unhealthy {
                check: Waiver::Retired,
                what: "memory pages wait to be retired: reset the GPU (or reboot) before using it"
                    .into(),
                slows: false,
            });
        }
        if self.remap_failed == Some(true) {
            v.push(Unhealthy {
                check: Waiver::Remap,
                what: "a memory row remap failed: the GPU needs service".into(),
                slows: false,
            });
        } else if self.remap_pending == Some(true) {
            v.push(Unhealthy {
                check: Waiver::Remap,
                what: "memory rows wait to be remapped: reset the GPU before using it".into(),
                slows: false,
            });
        }
        if !self.slowdowns.is_empty() {
            v.push(Unhealthy {
                check: Waiver::Throttle,
                what: format!(
                    "clocks slowed down now ({}): check cooling and power",
                    self.slowdowns.join(", ")
                ),
                slows: true,
            });
        }
        if self.mig == Some(true) {
            v.push(Unhealthy {
                check: Waiver::Mig,
                what: "MIG mode is on: NCCL cannot span MIG instances of several GPUs".into(),
                slows: false,
            });
        }
        v
    }

    /// One line: "41 C, persistence on, ECC 0, no slowdown".
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(t) = self.temperature_c {
            parts.push(format!("{t} C"));
        }
        if let Some(p) = self.persistence {
            parts.push(format!("persistence {}", if p { "on" } else { "off" }));
        }
        if let Some(n) = self.ecc_uncorrected {
            parts.push(format!("uncorrectable ECC {n}"));
        }
        parts.push(match self.slowdowns.is_empty() {
            true => "no slowdown".into(),
            false => format!("slowed down: {}", self.slowdowns.join(", ")),
        });
        if self.mig == Some(true) {
            parts.push("MIG on".into());
        }
        if let Some(n) = self.nvlink_errors.filter(|n| *n > 0) {
            parts.push(format!("NVLink errors {n} since the driver loaded"));
        }
        parts.join(", ")
    }
}

/// The health of a GPU NVML has opened.
fn health(dev: &nvml_wrapper::Device<'_>) -> Health {
    use nvml_wrapper::bitmasks::device::ThrottleReasons as T;
    use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
    let reasons = dev.current_throttle_reasons().unwrap_or(T::empty());
    let slowdowns = [
        (T::HW_SLOWDOWN, "hardware slowdown"),
        (T::HW_THERMAL_SLOWDOWN, "hardware thermal"),
        (T::HW_POWER_BRAKE_SLOWDOWN, "power brake"),
        (T::SW_THERMAL_SLOWDOWN, "software thermal"),
    ]
    .iter()
    .filter(|(r, _)| reasons.contains(*r))
    .map(|(_, n)| n.to_string())
    .collect();
    let remap = remapped_rows(dev);
    let nvlink_errors = nvlink_errors(dev);
    Health {
        temperature_c: dev.temperature(TemperatureSensor::Gpu).ok(),
        persistence: dev.is_in_persistent_mode().ok(),
        ecc_uncorrected: dev
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok(),
        pages_pending_retirement: dev.are_pages_pending_retired().ok(),
        slowdowns,
        mig: dev.mig_mode().ok().map(|m| m.current == 1),
        remap_pending: remap.map(|r| r.0),
        remap_failed: remap.map(|r| r.1),
        nvlink_errors,
    }
}

/// Whether rows wait to be remapped, and whether a remap failed (None: not supported). The
/// wrapper crate has no call for it; the symbol is looked up like the others, so a driver
/// without it answers None.
fn remapped_rows(dev: &nvml_wrapper::Device<'_>) -> Option<(bool, bool)> {
    let f = dev.nvml().lib().nvmlDeviceGetRemappedRows.as_ref().ok()?;
    let (mut corr, mut unc, mut pending, mut failed) = (0, 0, 0, 0);
    // SAFETY: the handle is live while `dev` is; NVML writes the four out-parameters.
    let rc = unsafe { f(dev.handle(), &mut corr, &mut unc, &mut pending, &mut failed) };
    (rc == 0).then_some((pending != 0, failed != 0))
}

/// NVLink replay, recovery and CRC errors summed over the links that are up.
fn nvlink_errors(dev: &nvml_wrapper::Device<'_>) -> Option<u64> {
    use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter as E;
    let mut sum = None;
    for link in 0..18 {
        let w = dev.link_wrapper_for(link);
        if !w.is_active().unwrap_or(false) {
            continue;
        }
        for c in [E::DlReplay, E::DlRecovery, E::DlCrcFlit, E::DlCrcData] {
            if let Ok(n) = w.error_counter(c) {
                *sum.get_or_insert(0) += n;
            }
        }
    }
    sum
}

/// The links and health of the GPU at PCI bus id `bus_id` (as CUDA writes it).
pub(crate) fn inspect(bus_id: &str) -> nrun_base::error::Result<(Links, Health)> {
    let nvml = nvml_wrapper::Nvml::init()
        .map_err(|e| nrun_base::error::Error::internal(format!("NVML: {e}")))?;
    let dev = nvml
        .device_by_pci_bus_id(bus_id)
        .map_err(|e| nrun_base::error::Error::internal(format!("NVML: GPU {bus_id}: {e}")))?;
    let mut l = Links {
        pcie_gen: dev.current_pcie_link_gen().unwrap_or(0),
        pcie_width: dev.current_pcie_link_width().unwrap_or(0),
        pcie_max_gen: dev.max_pcie_link_gen().unwrap_or(0),
        pcie_max_width: dev.max_pcie_link_width().unwrap_or(0),
        ..Links::default()
    };
    // NVML_NVLINK_MAX_LINKS is 18 on Hopper; a GPU without NVLink answers "not supported".
    for link in 0..18 {
        let w = dev.link_wrapper_for(link);
        if w.is_active().unwrap_or(false) {
            l.nvlink_up += 1;
            l.nvlink_version = w.version().unwrap_or(6);
            l.nvlink_gbs = nvlink_gbs(l.nvlink_version);
        }
    }
    let h = health(&dev);
    // No nvmlShutdown: the preflight rank ends with _exit beside CUDA and NCCL, and NVML's
    // teardown racing them is not worth the tidiness.
    std::mem::forget(nvml);
    Ok((l, h))
}

/// The CPUs NVML calls close to GPU `index` (its NUMA node's).
pub fn cpu_affinity(index: u32) -> nrun_base::error::Result<Vec<usize>> {
    let nvml = nvml_wrapper::Nvml::init()
        .map_err(|e| nrun_base::error::Error::internal(format!("NVML: {e}")))?;
    let dev = nvml
        .device_by_index(index)
        .map_err(|e| nrun_base::error::Error::internal(format!("NVML: GPU {index}: {e}")))?;
    let words = dev
        .cpu_affinity(16)
        .map_err(|e| nrun_base::error::Error::internal(format!("NVML: GPU {index}'s CPUs: {e}")))?;
    let bits = 8 * std::mem::size_of::<std::os::raw::c_ulong>();
    let cpus: Vec<usize> = words
        .iter()
        .enumerate()
        .flat_map(|(w, word)| {
            (0..bits)
                .filter(move |b| word >> b & 1 == 1)
                .map(move |b| w * bits + b)
        })
        .collect();
    if cpus.is_empty() {
        return Err(nrun_base::error::Error::internal(format!(
            "NVML names no CPUs for GPU {index}"
        )));
    }
    Ok(cpus)
}

/// Every GPU of this host with its health, for `nrun doctor` and the facts (None: no NVML).
pub fn all_gpus() -> Option<Vec<(String, Health)>> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let n = nvml.device_count().ok()?;
    Some(
        (0..n)
            .filter_map(|i| nvml.device_by_index(i).ok())
            .map(|d| {
                let bus = d.pci_info().map(|p| p.bus_id).unwrap_or_default();
                (bus, health(&d))
            })
            .collect(),
    )
}

/// A network interface a rank's traffic leaves by, as sysfs reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Nic {
    /// "eth0", or an InfiniBand/RoCE port as NCCL names it, "mlx5_0:1".
    pub name: String,
    /// Link speed in Mb/s (None: the interface does not say, as loopback and some virtual ones).
    pub mbps: Option<u64>,
    pub up: bool,
}

impl Nic {
    pub fn read(name: &str) -> Nic {
        Nic::read_at(std::path::Path::new("/sys/class"), name)
    }

    /// `name` under a sysfs class directory `root` (tests pass a recorded tree).
    pub(crate) fn read_at(root: &std::path::Path, name: &str) -> Nic {
        let read = |p: std::path::PathBuf| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        match name.split_once(':') {
            // An InfiniBand/RoCE port: rate "400 Gb/sec (4X NDR)", state "4: ACTIVE".
            Some((dev, port)) => {
                let dir = root.join("infiniband").join(dev).join("ports").join(port);
                let rate = read(dir.join("rate"));
                let gbits = rate
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<f64>().ok());
                Nic {
                    name: name.to_string(),
                    mbps: gbits.map(|g| (g * 1000.0) as u64).filter(|m| *m > 0),
                    up: read(dir.join("state")).contains("ACTIVE"),
                }
            }
            None => {
                let dir = root.join("net").join(name);
                // -1 (or an error) when the driver does not know, e.g. a link that is down.
                let speed = read(dir.join("speed")).parse::<i64>().ok();
                Nic {
                    name: name.to_string(),
                    mbps: speed.filter(|s| *s > 0).map(|s| s as u64),
                    up: matches!(read(dir.join("operstate")).as_str(), "up" | "unknown"),
                }
            }
        }
    }

    /// Bytes per second it carries at its speed, in GB/s.
    pub fn gbs(&self) -> Option<f64> {
        self.mbps.map(|m| m as f64 / 8000.0)
    }

    /// "eth0 10 Gb/s", "mlx5_0:1 400 Gb/s", "eth0 (speed unknown)".
    pub fn describe(&self) -> String {
        match self.mbps {
            Some(m) => format!("{} {}", self.name, speed_text(m)),
            None => format!("{} (speed unknown)", self.name),
        }
    }
}

/// "10 Gb/s", "2.5 Gb/s", "100 Mb/s".
pub(crate) fn speed_text(mbps: u64) -> String {
    if mbps >= 1000 {
        let g = mbps as f64 / 1000.0;
        if g.fract() == 0.0 {
            format!("{g:.0} Gb/s")
        } else {
            format!("{g:.1} Gb/s")
        }
    } else {
        format!("{mbps} Mb/s")
    }
}

/// The path NCCL took, from its INFO log: connections per transport, and channels.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NcclPath {
    /// "P2P/CUMEM" (NVLink or PCIe peer to peer), "SHM", "NET/Socket", "NET/IB", ... -> count.
    pub transports: BTreeMap<String, u32>,
    pub channels: u32,
    /// The network devices NET connections went through ("eth0", "mlx5_0:1").
    #[serde(default)]
    pub nics: Vec<String>,
}

impl NcclPath {
    /// One line for the report: "P2P/CUMEM x48, 24 channels".
    pub fn describe(&self) -> String {
        let t: Vec<String> = self
            .transports
            .iter()
            .map(|(k, v)| format!("{k} x{v}"))
            .collect();
        let nics = match self.nics.is_empty() {
            true => String::new(),
            false => format!(" through {}", self.nics.join(", ")),
        };
        format!("{}{nics}, {} channels", t.join(" + "), self.channels)
    }

    /// Whether every connection went peer to peer (NVLink or PCIe P2P).
    pub(crate) fn all_p2p(&self) -> bool {
        !self.transports.is_empty() && self.transports.keys().all(|k| k.starts_with("P2P"))
    }
}

/// Parses NCCL's INFO lines such as
/// `host:123:456 [0] NCCL INFO Channel 03/0 : 0[0] -> 1[1] via P2P/CUMEM/read`.
pub(crate) fn parse_nccl_log(text: &str) -> NcclPath {
    let mut p = NcclPath::default();
    let mut channels = std::collections::BTreeSet::new();
    // Each network transport's devices by index, from `NET/IB : Using [0]mlx5_0:1/IB [1]...`
    // and `NET/Socket : Using [0]eth0:10.0.0.1<0>`.
    let mut devices: BTreeMap<(String, String), String> = BTreeMap::new();
    let mut used = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some((kind, list)) = line
            .split("NCCL INFO NET/")
            .nth(1)
            .and_then(|r| r.split_once(" : Using "))
        {
            for dev in list.split(';').next().unwrap_or("").split_whitespace() {
                let Some((idx, name)) = dev.strip_prefix('[').and_then(|d| d.split_once(']'))
                else {
                    continue;
                };
                // mlx5_0:1/IB -> mlx5_0:1; eth0:10.0.0.1<0> -> eth0.
                let name = match kind {
                    "Socket" => name.split(':').next().unwrap_or(name),
                    _ => name.split('/').next().unwrap_or(name),
                };
                if idx.chars().all(|c| c.is_ascii_digit()) && !name.is_empty() {
                    devices.insert((kind.to_string(), idx.to_string()), name.to_string());
                }
            }
            continue;
        }
        let Some(rest) = line.split("NCCL INFO Channel ").nth(1) else {
            continue;
        };
        let Some(via) = rest.split(" via ").nth(1) else {
            continue;
        };
        // "03/0 : ..." (P2P, NET) or "03 : ..." (SHM): the channel is the leading number.
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(ch) = digits.parse::<u32>() {
            channels.insert(ch);
        }
        // The transport and its kind: P2P/CUMEM/read -> P2P/CUMEM, NET/IB/0/GDRDMA -> NET/IB.
        let mut parts = via.split_whitespace().next().unwrap_or("").split('/');
        let kind = match (parts.next(), parts.next()) {
            (Some("NET"), Some(b)) => {
                if let Some(idx) = parts.next() {
                    used.insert((b.to_string(), idx.to_string()));
                }
                format!("NET/{b}")
            }
            (Some(a @ "P2P"), Some(b)) => format!("{a}/{b}"),
            (Some(a), _) => a.to_string(),
            _ => continue,
        };
        *p.transports.entry(kind).or_default() += 1;
    }
    p.channels = channels.len() as u32;
    let nics: std::collections::BTreeSet<String> = used
        .iter()
        .filter_map(|k| devices.get(k).cloned())
        .collect();
    p.nics = nics.into_iter().collect();
    p
}

/// The NCCL variables set that change its path or speed, each with what it does.
pub fn path_variables(env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    const VARS: [(&str, &str); 12] = [
        ("NCCL_P2P_DISABLE", "disables NVLink/PCIe peer to peer"),
        ("NCCL_P2P_LEVEL", "limits where peer to peer is used"),
        (
            "NCCL_SHM_DISABLE",
            "disables shared memory between local GPUs",
        ),
        ("NCCL_NET", "forces a network transport"),
        ("NCCL_IB_DISABLE", "disables InfiniBand/RoCE"),
        ("NCCL_NET_GDR_LEVEL", "limits GPUDirect RDMA"),
        ("NCCL_MAX_NCHANNELS", "caps the channels"),
        ("NCCL_MIN_NCHANNELS", "sets the channels"),
        ("NCCL_MAX_CTAS", "caps the channels' thread blocks"),
        ("NCCL_BUFFSIZE", "sets the buffer per channel"),
        ("NCCL_ALGO", "forces an algorithm"),
        ("NCCL_PROTO", "forces a protocol"),
    ];
    VARS.iter()
        .filter_map(|(k, what)| env(k).map(|v| format!("{k}={v} ({what})")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as NCCL 2.28 writes them on the 2x H200 machine, healthy and with P2P/SHM off.
    const HEALTHY: &str = "\
vm:1043:1101 [0] NCCL INFO Channel 00/24 : 0 1
vm:1043:1101 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
vm:1043:1101 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
vm:1043:1101 [0] NCCL INFO Channel 23/0 : 0[0] -> 1[1] via P2P/CUMEM/read
vm:1043:1101 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 1
";
    const SHM: &str = "\
vm:1043:1101 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct
vm:1043:1101 [0] NCCL INFO Channel 01 : 0[0] -> 1[1] via SHM/direct/direct
";
    const SOCKETS: &str = "\
vm:1043:1101 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0
vm:1043:1101 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] [send] via NET/Socket/0
vm:1043:1101 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0
";

    /// NCCL 2.28.9's own logs (NCCL_DEBUG_SUBSYS=P2P,SHM,NET), rank 0 of 2 on the 2x H200
    /// machine: healthy, NCCL_P2P_DISABLE=1, and NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1.
    #[test]
    fn real_nccl_logs_give_the_path() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/nccl/");
        let read = |f: &str| std::fs::read_to_string(format!("{dir}{f}")).unwrap();
        let p = parse_nccl_log(&read("h200x2-healthy.log"));
        assert_eq!(p.transports.get("P2P/CUMEM"), Some(&24), "{p:?}");
        assert_eq!(p.channels, 24);
        assert!(p.all_p2p());
        let p = parse_nccl_log(&read("h200x2-p2p-disable.log"));
        assert_eq!(
            (p.transports.get("SHM"), p.channels),
            (Some(&4), 4),
            "{p:?}"
        );
        assert!(!p.all_p2p());
        let p = parse_nccl_log(&read("h200x2-p2p-shm-disable.log"));
        assert_eq!(p.transports.get("NET/Socket"), Some(&4), "{p:?}");
        assert_eq!(p.channels, 2);
        assert_eq!(p.nics, ["eth0"]);
        assert_eq!(p.describe(), "NET/Socket x4 through eth0, 2 channels");
        // Devices listed but unused are not a path.
        assert!(parse_nccl_log(&read("h200x2-healthy.log")).nics.is_empty());
    }

    /// NCCL's lines on an InfiniBand cluster: the devices by index, then channels through them.
    #[test]
    fn the_nics_nccl_used_are_named() {
        let log = "\
n1:9:9 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/RoCE [RO]; OOB ib0:10.0.0.1<0>
n1:9:9 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [send] via NET/IB/1/GDRDMA
n1:9:9 [0] NCCL INFO Channel 01/0 : 15[7] -> 0[0] [receive] via NET/IB/0/GDRDMA
n1:9:9 [0] NCCL INFO Channel 02/0 : 15[7] -> 0[0] [receive] via NET/IB/0/GDRDMA
";
        let p = parse_nccl_log(log);
        assert_eq!(p.nics, ["mlx5_0:1", "mlx5_3:1"]);
        assert_eq!(p.transports.get("NET/IB"), Some(&3));
    }

    #[test]
    fn nic_speeds_from_sysfs() {
        let root = tempfile::tempdir().unwrap();
        let put = |p: &str, v: &str| {
            let f = root.path().join(p);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(f, v).unwrap();
        };
        put("net/eth0/speed", "25000\n");
        put("net/eth0/operstate", "up\n");
        put("net/eth1/speed", "-1\n");
        put("net/eth1/operstate", "down\n");
        put("infiniband/mlx5_0/ports/1/rate", "400 Gb/sec (4X NDR)\n");
        put("infiniband/mlx5_0/ports/1/state", "4: ACTIVE\n");
        put("infiniband/mlx5_1/ports/1/rate", "2.5 Gb/sec (1X SDR)\n");
        put("infiniband/mlx5_1/ports/1/state", "1: DOWN\n");
        let n = Nic::read_at(root.path(), "eth0");
        assert_eq!((n.mbps, n.up), (Some(25000), true));
        assert_eq!(n.describe(), "eth0 25 Gb/s");
        assert_eq!(n.gbs(), Some(3.125));
        let n = Nic::read_at(root.path(), "eth1");
        assert_eq!((n.mbps, n.up), (None, false));
        assert_eq!(n.describe(), "eth1 (speed unknown)");
        let n = Nic::read_at(root.path(), "mlx5_0:1");
        assert_eq!((n.mbps, n.up), (Some(400_000), true));
        let n = Nic::read_at(root.path(), "mlx5_1:1");
        assert_eq!(
            (n.describe(), n.up),
            ("mlx5_1:1 2.5 Gb/s".to_string(), false)
        );
        assert_eq!(Nic::read_at(root.path(), "nope").mbps, None);
        assert_eq!(speed_text(100), "100 Mb/s");
    }

    #[test]
    fn nccl_logs_give_the_path() {
        let p = parse_nccl_log(HEALTHY);
        assert_eq!(p.transports.get("P2P/CUMEM"), Some(&3));
        assert_eq!(p.channels, 3);
        assert!(p.all_p2p());
        assert_eq!(p.describe(), "P2P/CUMEM x3, 3 channels");
        let p = parse_nccl_log(SOCKETS);
        assert_eq!(p.transports.get("NET/Socket"), Some(&3));
        assert_eq!(p.channels, 2);
        assert!(!p.all_p2p());
        assert_eq!(parse_nccl_log("nothing here"), NcclPath::default());
        let p = parse_nccl_log(SHM);
        assert_eq!((p.transports.get("SHM"), p.channels), (Some(&2), 2));
    }

    #[test]
    fn health_problems_by_check() {
        let ok = Health {
            temperature_c: Some(41),
            persistence: Some(true),
            ecc_uncorrected: Some(0),
            pages_pending_retirement: Some(false),
            slowdowns: vec![],
            mig: Some(false),
            remap_pending: Some(false),
            remap_failed: Some(false),
            nvlink_errors: Some(0),
        };
        assert!(ok.problems().is_empty());
        assert_eq!(
            ok.describe(),
            "41 C, persistence on, uncorrectable ECC 0, no slowdown"
        );
        let bad = Health {
            ecc_uncorrected: Some(3),
            slowdowns: vec!["power brake".into()],
            mig: Some(true),
            remap_pending: Some(true),
            nvlink_errors: Some(12),
            ..ok.clone()
        };
        let p = bad.problems();
        let checks: Vec<&str> = p.iter().map(|u| u.check.name()).collect();
        assert_eq!(checks, ["ecc", "remap", "throttle", "mig"]);
        assert!(p[2].slows && !p[0].slows && !p[1].slows);
        // The names --waive takes are the checks' own.
        for w in Waiver::ALL {
            assert_eq!(w.name().parse::<Waiver>().unwrap(), w);
        }
        assert_eq!(
            "ECC".parse::<Waiver>().unwrap_err().to_string(),
            "--waive \"ECC\": expected ecc, retired, remap, throttle or mig"
        );
        assert!(
            bad.describe().contains("NVLink errors 12"),
            "{}",
            bad.describe()
        );
        let failed = Health {
            remap_failed: Some(true),
            ..ok
        };
        assert!(failed.problems()[0].what.contains("remap failed"));
    }

    #[test]
    fn line_rates() {
        assert_eq!(nvlink_gbs(6), 25.0);
        assert_eq!(nvlink_gbs(7), 50.0);
        let nv = Links {
            nvlink_up: 18,
            nvlink_gbs: 25.0,
            nvlink_version: 6,
            pcie_gen: 5,
            pcie_width: 16,
            pcie_max_gen: 5,
            pcie_max_width: 16,
        };
        assert_eq!(nv.line_rate().0, 450.0);
        assert!(nv.line_rate().1.starts_with("NVLink 18 links x 25 GB/s"));
        assert!(!nv.pcie_degraded());
        let pcie = Links {
            nvlink_up: 0,
            pcie_gen: 4,
            pcie_width: 4,
            ..nv
        };
        assert!((pcie.line_rate().0 - 7.876).abs() < 0.01);
        assert!(pcie.pcie_degraded());
        let env = |k: &str| (k == "NCCL_P2P_DISABLE").then(|| "1".to_string());
        assert_eq!(
            path_variables(&env),
            ["NCCL_P2P_DISABLE=1 (disables NVLink/PCIe peer to peer)"]
        );
    }
}
