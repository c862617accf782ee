//! A generic SVG line plot (plotters): named series of (x, y) points over a
//! logarithmic x axis and a linear y axis. Nothing in it is specific to aggregation;
//! it is kept here until the benchmarks share a plot module.

use plotters::prelude::*;
use std::path::Path;

/// One line of a plot.
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Axis titles and the plot's caption.
pub struct Labels<'a> {
    pub title: &'a str,
    pub x: &'a str,
    pub y: &'a str,
}

/// Distinct, print-friendly colors (the Tableau 10 palette), cycled.
fn color(i: usize) -> RGBColor {
    const PALETTE: [(u8, u8, u8); 10] = [
        (31, 119, 180),
        (214, 39, 40),
        (44, 160, 44),
        (255, 127, 14),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (188, 189, 34),
        (23, 190, 207),
    ];
    let (r, g, b) = PALETTE[i % PALETTE.len()];
    RGBColor(r, g, b)
}

/// Draws `lines` into the SVG file `path`, x logarithmic. Points with x ≤ 0 cannot be
/// placed on a log axis and are an error.
pub fn log_x_svg(path: &Path, labels: &Labels<'_>, lines: &[Line]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let xs = || lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    if let Some(bad) = xs().find(|&x| x <= 0.0 || !x.is_finite()) {
        return Err(format!(
            "drawing {}: x = {bad} on a log axis",
            path.display()
        ));
    }
    let min_x = xs().fold(f64::INFINITY, f64::min);
    let max_x = xs().fold(0.0, f64::max);
    let (min_x, max_x) = if min_x.is_finite() {
        (min_x, max_x.max(min_x * 10.0))
    } else {
        (1.0, 10.0)
    };
    let max_y = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.1;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(labels.title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((min_x..max_x).log_scale(), 0.0..max_y)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(labels.x)
        .y_desc(labels.y)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, line) in lines.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(
                line.points.iter().copied(),
                c.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(line.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(line.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_lines_and_rejects_non_positive_x() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.svg");
        let lines = vec![
            Line {
                label: "alpha".into(),
                points: vec![(1.0, 2.0), (10.0, 3.0), (1000.0, 1.0)],
            },
            Line {
                label: "beta".into(),
                points: vec![(1.0, 1.0), (1000.0, 4.0)],
            },
        ];
        let labels = Labels {
            title: "t",
            x: "groups",
            y: "ms",
        };
        log_x_svg(&path, &labels, &lines).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("alpha") && svg.contains("beta") && svg.contains("groups"));
        let bad = vec![Line {
            label: "x".into(),
            points: vec![(0.0, 1.0)],
        }];
        assert!(log_x_svg(&path, &labels, &bad).is_err());
    }
}
