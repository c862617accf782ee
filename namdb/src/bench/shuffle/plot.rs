//! The shuffle benchmark's plots: throughput (GB/s per node) against message size per
//! design and baseline, and throughput per design, drawn by [`crate::bench::plot`].

use crate::bench::plot::{self as generic, Axes};
use std::path::Path;

pub use generic::Series;

/// The x axis: message sizes in bytes (logarithmic), or designs by index.
pub enum XAxis<'a> {
    MessageBytes,
    Categories(&'a [String]),
}

/// Draws `series` to `path`; the y axis is GB/s per node.
pub fn line_svg(path: &Path, title: &str, x: XAxis<'_>, series: &[Series]) -> Result<(), String> {
    let (x, desc) = match x {
        XAxis::MessageBytes => (generic::XAxis::MessageBytes, "message size"),
        XAxis::Categories(names) => (generic::XAxis::Categories(names), "design"),
    };
    let axes = Axes {
        x: desc,
        y: "GB/s received per node",
    };
    generic::line_svg(path, title, x, &axes, series)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_both_kinds_of_axis() {
        let dir = tempfile::tempdir().unwrap();
        let series = vec![
            Series {
                label: "MEMQ/WR".into(),
                points: vec![(4096.0, 1.0), (65536.0, 2.5), (1048576.0, 3.0)],
            },
            Series {
                label: "tcp".into(),
                points: vec![(4096.0, 0.5), (65536.0, 1.0)],
            },
        ];
        let p = dir.path().join("sizes.svg");
        line_svg(&p, "t", XAxis::MessageBytes, &series).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.contains("MEMQ/WR") && svg.contains("64 KiB") && svg.contains("1 MiB"));
        assert_eq!(svg.matches("<circle").count(), 5);
        let names = vec!["SESQ/SR".to_string(), "tcp".to_string()];
        let p = dir.path().join("designs.svg");
        let s = vec![Series {
            label: "repartition".into(),
            points: vec![(0.0, 1.0), (1.0, 0.5)],
        }];
        line_svg(&p, "t", XAxis::Categories(&names), &s).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.contains("SESQ/SR") && svg.contains("repartition"));
    }
}
