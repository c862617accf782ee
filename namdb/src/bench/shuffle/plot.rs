//! SVG line plots of the shuffle benchmark (plotters, as `tpcw::plot`): throughput
//! against message size per design and baseline, and throughput per design.

use plotters::prelude::*;
use std::path::Path;

/// One line: a label and its (x, GB/s) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// The x axis: message sizes in bytes (logarithmic), or categories by index.
pub enum XAxis<'a> {
    MessageBytes,
    Categories(&'a [String]),
}

fn size_label(bytes: f64) -> String {
    if bytes >= (1 << 20) as f64 {
        format!("{:.0} MiB", bytes / (1 << 20) as f64)
    } else {
        format!("{:.0} KiB", bytes / 1024.0)
    }
}

/// Draws `series` to `path`; the y axis is GB/s per node.
pub fn line_svg(path: &Path, title: &str, x: XAxis<'_>, series: &[Series]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let max_y = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max)
        .max(0.01)
        * 1.15;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(70);
    macro_rules! finish {
        ($chart:expr, $desc:expr, $labels:expr, $fmt:expr, $map:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc($desc)
                .x_labels($labels)
                .y_desc("GB/s received per node")
                .x_label_formatter($fmt)
                .draw()
                .map_err(|e| err(&e))?;
            for (i, s) in series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let pts: Vec<_> = s.points.iter().map($map).collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(s.label.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
                    .map_err(|e| err(&e))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        }};
    }
    match x {
        XAxis::MessageBytes => {
            // log2 of the size on a linear axis, so the ticks fall on powers of two.
            let xs = series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0.log2()));
            let lo = xs.clone().fold(f64::MAX, f64::min).min(12.0).floor();
            let hi = xs.fold(0.0, f64::max).max(lo + 1.0).ceil();
            let chart = builder
                .build_cartesian_2d(lo - 0.5..hi + 0.5, 0f64..max_y)
                .map_err(|e| err(&e))?;
            let label = |v: &f64| {
                if (v - v.round()).abs() < 1e-6 {
                    size_label(v.round().exp2())
                } else {
                    String::new()
                }
            };
            finish!(
                chart,
                "message size",
                (hi - lo) as usize + 2,
                &label,
                |&(x, y): &(f64, f64)| (x.log2(), y)
            );
        }
        XAxis::Categories(names) => {
            let n = names.len().max(1) as i32;
            let chart = builder
                .build_cartesian_2d(-1i32..n, 0f64..max_y)
                .map_err(|e| err(&e))?;
            let label = |v: &i32| {
                usize::try_from(*v)
                    .ok()
                    .and_then(|i| names.get(i))
                    .cloned()
                    .unwrap_or_default()
            };
            finish!(chart, "design", names.len() + 2, &label, |&(x, y): &(
                f64,
                f64
            )| (
                x as i32, y
            ));
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
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
