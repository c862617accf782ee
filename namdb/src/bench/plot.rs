//! SVG line plots of the benchmarks (plotters, as `tpcw::plot`): lines of points over
//! a linear axis, message sizes (logarithmic) or categories.

use plotters::prelude::*;
use std::path::Path;

/// One line: a label and its (x, y) points.
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

/// The x axis: plain numbers, numbers spanning decades (logarithmic: clients, groups),
/// message sizes in bytes (logarithmic), or categories by index.
pub enum XAxis<'a> {
    Linear,
    Log10,
    MessageBytes,
    Categories(&'a [String]),
}

/// 1, 10, 100, 1k, 10k, 100k, 1M, …
fn decade_label(v: f64) -> String {
    match v {
        v if v >= 1e9 => format!("{}G", v / 1e9),
        v if v >= 1e6 => format!("{}M", v / 1e6),
        v if v >= 1e3 => format!("{}k", v / 1e3),
        v => format!("{v}"),
    }
}

fn size_label(bytes: f64) -> String {
    if bytes >= (1 << 20) as f64 {
        format!("{:.0} MiB", bytes / (1 << 20) as f64)
    } else {
        format!("{:.0} KiB", bytes / 1024.0)
    }
}

/// The axis descriptions.
pub struct Axes<'a> {
    pub x: &'a str,
    pub y: &'a str,
}

/// Draws `series` to `path`, the y axis from 0.
pub fn line_svg(
    path: &Path,
    title: &str,
    x: XAxis<'_>,
    axes: &Axes<'_>,
    series: &[Series],
) -> Result<(), String> {
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
                .y_desc(axes.y)
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
        XAxis::Linear => {
            let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
            let lo = xs.clone().fold(f64::MAX, f64::min).min(0.0);
            let hi = xs.fold(f64::MIN, f64::max).max(lo + 1e-9);
            let pad = (hi - lo) * 0.05;
            let chart = builder
                .build_cartesian_2d(lo - pad..hi + pad, 0f64..max_y)
                .map_err(|e| err(&e))?;
            let label = |v: &f64| format!("{v}");
            finish!(chart, axes.x, 10, &label, |&p: &(f64, f64)| p);
        }
        XAxis::Log10 => {
            // log10 of x on a linear axis, so the ticks fall on powers of ten.
            let xs = series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0.max(1.0).log10()));
            let lo = xs.clone().fold(f64::MAX, f64::min).min(0.0).floor();
            let hi = xs.fold(0.0, f64::max).max(lo + 1.0).ceil();
            let chart = builder
                .build_cartesian_2d(lo - 0.2..hi + 0.2, 0f64..max_y)
                .map_err(|e| err(&e))?;
            let label = |v: &f64| {
                if (v - v.round()).abs() < 1e-6 {
                    decade_label(10f64.powf(v.round()))
                } else {
                    String::new()
                }
            };
            finish!(
                chart,
                axes.x,
                ((hi - lo) * 5.0) as usize + 2,
                &label,
                |&(x, y): &(f64, f64)| (x.max(1.0).log10(), y)
            );
        }
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
                axes.x,
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
            finish!(chart, axes.x, names.len() + 2, &label, |&(x, y): &(
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
    fn draws_a_linear_axis_with_its_descriptions() {
        let dir = tempfile::tempdir().unwrap();
        let series = vec![
            Series {
                label: "rrj".into(),
                points: vec![(0.25, 10.0), (0.5, 12.0), (1.0, 20.0)],
            },
            Series {
                label: "duckdb".into(),
                points: vec![(0.25, 8.0), (1.0, 9.0)],
            },
        ];
        let p = dir.path().join("linear.svg");
        let axes = Axes {
            x: "selectivity",
            y: "runtime (ms)",
        };
        line_svg(&p, "t", XAxis::Linear, &axes, &series).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.contains("rrj") && svg.contains("duckdb"));
        assert!(svg.contains("selectivity") && svg.contains("runtime (ms)"));
        assert_eq!(svg.matches("<circle").count(), 5);
    }

    #[test]
    fn a_log_axis_is_labelled_in_decades() {
        let dir = tempfile::tempdir().unwrap();
        let series = vec![Series {
            label: "two-phase".into(),
            points: vec![(1.0, 3.0), (100.0, 4.0), (1e6, 9.0)],
        }];
        let p = dir.path().join("log.svg");
        let axes = Axes {
            x: "groups",
            y: "runtime (ms)",
        };
        line_svg(&p, "t", XAxis::Log10, &axes, &series).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.contains("\n1k\n") && svg.contains("\n1M\n"), "{svg}");
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(
            line_svg(
                Path::new("/nonexistent/x.svg"),
                "t",
                XAxis::Log10,
                &axes,
                &series
            )
            .is_err()
        );
    }
}
