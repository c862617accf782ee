//! SVG plots of sweeps: throughput against clients, one line per system (the shape of
//! the paper's Figure 6).

use plotters::prelude::*;
use std::path::Path;

/// One line: a label and its (clients, transactions per second) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(usize, f64)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

/// Draws `series` to `path` on a logarithmic clients axis.
pub fn throughput_svg(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let points = series.iter().flat_map(|s| s.points.iter());
    let max_clients = points.clone().map(|p| p.0).max().unwrap_or(1).max(2) as u32;
    let max_rate = points.map(|p| p.1).fold(0.0f64, f64::max).max(1.0) * 1.1;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(90)
        .build_cartesian_2d((1u32..max_clients).log_scale(), 0f64..max_rate)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("clients")
        .y_desc("transactions per second")
        .y_label_formatter(&|v| {
            if *v >= 1e6 {
                format!("{:.1} M", v / 1e6)
            } else {
                format!("{:.0} k", v / 1e3)
            }
        })
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(u32, f64)> = s.points.iter().map(|&(c, r)| (c as u32, r)).collect();
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
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_every_series_with_its_label() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sweep.svg");
        let series = vec![
            Series {
                label: "rsi (sim)".into(),
                points: vec![(1, 1e5), (8, 6e5), (64, 1.1e6)],
            },
            Series {
                label: "2pc".into(),
                points: vec![(1, 5e3), (8, 2e4), (64, 3e4)],
            },
        ];
        throughput_svg(&path, "TPC-W checkout", &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("rsi (sim)") && svg.contains("2pc") && svg.contains("clients"));
        // One marker per point.
        assert_eq!(svg.matches("<circle").count(), 6);
        assert!(throughput_svg(Path::new("/nonexistent/dir/x.svg"), "t", &series).is_err());
    }
}
