//! `[train.early_stopping]`'s state on the wire: worker 0's checkpoint cut
//! carries it to the coordinator, which keeps it in the manifest. Figures
//! travel as protobuf doubles, bit for bit.

use std::collections::BTreeMap;

use sparrow_core::metrics::tasks::TaskFigures;
use sparrow_proto::v1 as pb;
use sparrow_trainer::early_stopping::{Best, LastValidation, StoppingState};

pub(super) fn stopping_to_proto(s: StoppingState) -> pb::StoppingState {
    pb::StoppingState {
        has_best: s.best.is_some(),
        best_metric: s.best.map_or(0.0, |b| b.metric),
        best_step: s.best.map_or(0, |b| b.step),
        best_epoch: s.best.map_or(0, |b| b.epoch),
        since_best: s.since_best,
        validated_step: s.validated_step,
        has_last: s.last.is_some(),
        last_auc: s.last.as_ref().map_or(0.0, |l| l.auc),
        last_logloss: s.last.as_ref().map_or(0.0, |l| l.logloss),
        last_rows: s.last.as_ref().map_or(0, |l| l.rows),
        last_tasks: s.last.map(|l| l.tasks.iter().map(task_to_proto).collect()).unwrap_or_default(),
    }
}

pub(super) fn stopping_from(s: pb::StoppingState) -> StoppingState {
    let best = s.has_best.then_some(Best { metric: s.best_metric, step: s.best_step, epoch: s.best_epoch });
    let tasks: BTreeMap<String, TaskFigures> = s.last_tasks.into_iter().filter_map(task_from).collect();
    let last =
        s.has_last.then_some(LastValidation { auc: s.last_auc, logloss: s.last_logloss, rows: s.last_rows, tasks });
    StoppingState { best, since_best: s.since_best, validated_step: s.validated_step, last }
}

fn task_to_proto((task, f): (&String, &TaskFigures)) -> pb::TaskFigures {
    use pb::task_figures::Figures;
    let figures = match *f {
        TaskFigures::Binary { auc, logloss, ne, calibration, gauc, rows } => {
            Figures::Binary(pb::BinaryFigures { auc, logloss, ne, calibration, gauc, rows })
        }
        TaskFigures::Multiclass { accuracy, top_k_accuracy, macro_auc, logloss, rows } => {
            Figures::Multiclass(pb::MulticlassFigures { accuracy, top_k_accuracy, macro_auc, logloss, rows })
        }
    };
    pb::TaskFigures { task: task.clone(), figures: Some(figures) }
}

/// A task whose figures are missing (a peer that set none) is left out.
fn task_from(t: pb::TaskFigures) -> Option<(String, TaskFigures)> {
    use pb::task_figures::Figures;
    let figures = match t.figures? {
        Figures::Binary(b) => TaskFigures::Binary {
            auc: b.auc,
            logloss: b.logloss,
            ne: b.ne,
            calibration: b.calibration,
            gauc: b.gauc,
            rows: b.rows,
        },
        Figures::Multiclass(m) => TaskFigures::Multiclass {
            accuracy: m.accuracy,
            top_k_accuracy: m.top_k_accuracy,
            macro_auc: m.macro_auc,
            logloss: m.logloss,
            rows: m.rows,
        },
    };
    Some((t.task, figures))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state crosses the wire whole: every task's figures (GAUC or
    /// none, a multiclass task's) as they were.
    #[test]
    fn the_state_crosses_the_wire_whole() {
        let tasks = BTreeMap::from([
            (
                "click".to_string(),
                TaskFigures::Binary { auc: 0.61, logloss: 0.4, ne: 0.9, calibration: 1.1, gauc: Some(0.58), rows: 9 },
            ),
            (
                "cvr".to_string(),
                TaskFigures::Binary { auc: 0.7, logloss: 0.2, ne: 0.8, calibration: 0.9, gauc: None, rows: 9 },
            ),
            (
                "kind".to_string(),
                TaskFigures::Multiclass { accuracy: 0.5, top_k_accuracy: 1.0, macro_auc: 0.66, logloss: 1.0, rows: 9 },
            ),
        ]);
        let state = StoppingState {
            best: Some(Best { metric: 0.61, step: 40, epoch: 1 }),
            since_best: 2,
            validated_step: Some(41),
            last: Some(LastValidation { auc: 0.61, logloss: 0.4, rows: 9, tasks }),
        };
        assert_eq!(stopping_from(stopping_to_proto(state.clone())), state);
        let none = StoppingState::default();
        assert_eq!(stopping_from(stopping_to_proto(none.clone())), none);
    }
}
