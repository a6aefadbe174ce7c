"""The fast tier (``./run-tests.sh --fast``, ``pytest -m fast``): the unit and golden tests.

A test belongs here when it starts no MPI job, no Slurm, no container and no training run
longer than a second. :data:`FAST` lists them by file (``test_x.py``: every test in it) or by
test (``test_x.py::test_name``: every parametrisation of it). The collection hook marks them
``fast``; a listed test that carries the ``mpi``, ``slurm`` or ``container`` mark stops the
session (tests/test_testbed.py checks that every entry names a test that exists).
"""

from __future__ import annotations

import pytest

FAST = frozenset({
    "test_gpus.py",
    "test_hostmem.py",
    "test_import_graph.py",
    "test_results_size.py",
    "test_record.py",
    "test_child.py",
    "test_gpu_driver.py::test_gather_lists_the_compute_files_devices_and_binary",
    "test_gpu_driver.py::test_no_driver_is_not_an_error",
    "test_gpu_driver.py::test_a_driver_library_of_another_version_than_the_module_is_refused",
    "test_gpu_driver.py::test_cuda_runtime_versions_are_read_from_the_real_wheels",
    "test_gpu_driver.py::test_an_image_needing_a_newer_driver_is_refused",
    "test_gpu_driver.py::test_probe_without_a_driver_fails",
    "test_gpu_driver.py::test_probe_passes_in_the_drivers_libcuda_and_fails_in_a_stub",
    "test_abi.py",
    "test_averaging.py::test_standing_statistics_are_the_mean_over_the_batches_for_these_weights",
    "test_averaging.py::test_the_average_is_the_normalised_exponential_average_of_the_steps",
    "test_averaging.py::test_the_first_average_is_the_first_weights_and_the_state_round_trips",
    "test_cli.py::test_bad_option_value_is_an_error_hint",
    "test_cli.py::test_dry_run_inside_a_slurm_allocation_plans_srun",
    "test_cli.py::test_dry_run_json_is_the_plan_and_starts_nothing",
    "test_cli.py::test_dry_run_text_shows_env_and_argv",
    "test_cli.py::test_host_named_twice_with_conflicting_slots",
    "test_cli.py::test_missing_command",
    "test_cli.py::test_more_ranks_than_the_cpus_a_taskset_allows",
    "test_cli.py::test_more_ranks_times_threads_than_cores",
    "test_cli.py::test_unknown_mpi_behind_the_launcher",
    "test_cli.py::test_unknown_mpi_name",
    "test_cli.py::test_verbose_shows_the_traceback",
    "test_cli.py::test_zero_threads_per_rank",
    "test_container_plan.py",
    "test_data.py",
    "test_faults.py::test_a_pickle_checkpoint_that_would_run_code_is_refused",
    "test_faults.py::test_a_silent_rank_that_got_least_far_is_the_stalled_one",
    "test_faults.py::test_a_torch_checkpoint_that_would_run_code_is_refused",
    "test_faults.py::test_an_alive_rank_stuck_behind_is_blamed_not_the_ones_waiting_for_it",
    "test_faults.py::test_at_the_same_point_the_silent_rank_is_blamed_not_the_waiting_one",
    "test_faults.py::test_changed_settings_names_what_a_resume_changes",
    "test_faults.py::test_finished_ranks_are_not_stalled",
    "test_faults.py::test_real_checkpoint_contents_still_load",
    "test_faults.py::test_resume_skips_a_bad_newest_checkpoint_but_never_starts_over",
    "test_faults.py::test_the_automatic_bound_follows_the_longest_step_after_the_first",
    "test_hostlibs.py",
    "test_input_checks.py::test_a_good_job_script_is_still_written",
    "test_input_checks.py::test_a_valid_site_profile_without_a_container_is_used",
    "test_input_checks.py::test_container_options_without_a_container",
    "test_input_checks.py::test_job_options_that_would_be_ignored",
    "test_input_checks.py::test_jobs_check_the_training_arguments",
    "test_input_checks.py::test_launch_checks_the_training_arguments_once",
    "test_input_checks.py::test_malformed_env_default_is_an_error_naming_the_variable",
    "test_input_checks.py::test_missing_site_profile_without_a_container",
    "test_input_checks.py::test_options_of_the_other_launcher",
    "test_input_checks.py::test_resnet_refuses_the_3dgan_data_options",
    "test_input_checks.py::test_runtime_none_over_the_container_default_is_a_bare_run",
    "test_input_checks.py::test_site_profile_that_is_not_toml_without_a_container",
    "test_input_checks.py::test_someone_elses_train_is_not_checked",
    "test_input_checks.py::test_srun_inside_an_allocation_is_planned",
    "test_input_checks.py::test_srun_outside_an_allocation",
    "test_input_checks.py::test_train_refuses_numbers_and_options_it_would_ignore",
    "test_input_checks.py::test_well_formed_env_defaults_are_used",
    "test_keras_model.py::test_layer_config",
    "test_keras_model.py::test_module_imports_without_building",
    "test_keras_model.py::test_param_counts",
    "test_keras_model.py::test_symbolic_shapes",
    "test_layout.py",
    "test_learning_bench.py::test_a_doctored_verdict_is_caught",
    "test_learning_bench.py::test_a_failed_seed_ends_the_benchmark_without_starting_the_others",
    "test_learning_bench.py::test_a_failed_seed_stops_the_seeds_running_beside_it",
    "test_learning_bench.py::test_a_fall_within_the_seed_spread_fails",
    "test_learning_bench.py::test_budgets_only_for_a_constant_rate",
    "test_learning_bench.py::test_budgets_say_where_the_criteria_would_have_held",
    "test_learning_bench.py::test_committed_verdicts_are_the_judges",
    "test_learning_bench.py::test_data_response_bins_the_events_as_the_validation_does",
    "test_learning_bench.py::test_doctored_budgets_are_caught",
    "test_learning_bench.py::test_each_criterion_broken_alone_fails",
    "test_learning_bench.py::test_end_bin_spread_is_std_over_mean_per_side",
    "test_learning_bench.py::test_ended_at_cuts_the_run_there",
    "test_learning_bench.py::test_response_shape_reads_a_scaled_generator_as_scaled",
    "test_learning_bench.py::test_runs_that_meet_every_criterion_pass",
    ("test_learning_bench.py::"
     "test_settling_after_a_failure_sorts_the_other_seeds_by_how_they_ended"),
    "test_learning_bench.py::test_the_raw_generator_of_an_averaged_run_is_judged_as_the_control",
    "test_lrz.py::test_lrz_profile_leaves_libpmi2_to_hpcai",
    "test_models.py::test_batchnorm_over_depth_reproduces_cerns_parameter_counts",
    "test_models.py::test_bce_clipping",
    "test_models.py::test_bit_flip_rate",
    "test_models.py::test_constants_and_sampling_fraction",
    "test_models.py::test_discriminator_real_loss_parts",
    "test_models.py::test_forward_macs_match_spec",
    "test_models.py::test_generator_intermediate_shapes",
    "test_models.py::test_generator_output_nonnegative",
    "test_models.py::test_initialisers",
    "test_models.py::test_keras_defaults",
    "test_models.py::test_keras_reshape_order",
    "test_models.py::test_mape_formula",
    "test_models.py::test_parameter_counts",
    "test_models.py::test_per_layer_parameter_counts",
    "test_models.py::test_resnet_zero_init_residual",
    "test_models.py::test_same_padding_matches_keras",
    "test_models.py::test_sample_inputs",
    "test_models.py::test_upsample_and_zeropad",
    "test_perf_cli.py::test_predict_and_tune_refuse_bad_inputs",
    "test_perf_cli.py::test_predict_overlays_a_sweep_and_compares",
    "test_perf_cli.py::test_predict_user_errors",
    "test_perf_cli.py::test_predict_writes_report_table_and_plot",
    "test_perf_cli.py::test_site_profile_network_is_read",
    "test_perf_cli.py::test_tune_drops_layouts_that_do_not_fit_in_memory",
    "test_perf_cli.py::test_tune_generates_showers_once_instead_of_per_layout",
    "test_perf_cli.py::test_tune_result_round_trips_and_ranks_layouts",
    "test_perf_model.py",
    "test_physics.py::test_a_profile_axis_always_shows_two_labelled_decades",
    "test_physics.py::test_a_shower_shifted_by_one_layer_has_the_known_distance",
    ("test_physics.py::"
     "test_draws_repeat_the_real_energies_and_the_standard_error_is_the_spread_of_the_diff"),
    "test_physics.py::test_empty_generated_showers_are_counted",
    "test_physics.py::test_empty_generated_showers_bins_outside_and_json",
    "test_physics.py::test_generated_showers_must_share_the_real_energies",
    "test_physics.py::test_identical_showers_are_at_distance_zero",
    "test_physics.py::test_one_event_has_the_known_profiles_moments_hits_and_fraction",
    "test_physics.py::test_plots_behind_physics_json_are_found_on_resume",
    "test_physics.py::test_scaled_showers_and_a_biased_discriminator_give_known_errors",
    "test_physics.py::test_the_plot_clock_redraws_at_most_every_interval_and_always_at_the_end",
    "test_placement.py",
    "test_plan_golden.py",
    "test_pmi.py::test_pmi_choice_order",
    "test_pmi.py::test_pmi_intel_rank_is_pointed_at_slurms_library_or_warned",
    "test_pmi.py::test_pmi_library_found_named_or_refused",
    "test_pmi.py::test_pmi_library_only_for_intel_under_pmi2",
    "test_pmi.py::test_pmi_matching_plugin_is_planned",
    "test_pmi.py::test_pmi_mismatch_refused_before_the_rank_runs",
    "test_pmi.py::test_pmi_staged_library_is_pointed_at_inside_the_container",
    "test_pmi.py::test_pmi_step_mismatch",
    "test_pmi.py::test_pmi_step_plugin_reads_slurm_mpi_type",
    "test_probe.py::test_a_record_keeps_the_sample_counts",
    "test_probe.py::test_sample_count_fits_the_budget_within_its_bounds",
    "test_probe.py::test_sample_count_never_exceeds_the_sizes_most",
    "test_rankenv.py",
    "test_readme_results.py",
    "test_report.py",
    "test_runtimes.py",
    "test_sbatch.py::test_bad_job_specs",
    "test_sbatch.py::test_cli_bad_input_is_error_hint",
    "test_sbatch.py::test_job_script_matches_golden",
    "test_sbatch.py::test_lrz_script_says_what_the_seed_run_did",
    "test_sbatch.py::test_mpiexec_when_the_site_says_so",
    "test_sbatch.py::test_sweep_points_and_bad_lists",
    "test_sbatch.py::test_values_are_quoted",
    "test_schedule.py::test_constant_rate_after_the_warm_up_is_the_control",
    "test_schedule.py::test_cosine_runs_from_the_rate_to_near_zero_over_the_whole_run",
    "test_schedule.py::test_step_keeps_the_rate_for_four_fifths_then_a_tenth",
    "test_schedule.py::test_unknown_decay_is_an_error_not_a_constant",
    "test_schedule.py::test_warm_up_then_cosine_from_the_warm_up_end",
    "test_startup.py::test_startup_bad_job_dir_in_the_site_profile_is_an_error",
    "test_startup.py::test_startup_changed_file_of_the_key_is_an_error",
    "test_startup.py::test_startup_failed_planner_stops_the_others",
    "test_startup.py::test_startup_foreign_plan_is_an_error",
    "test_startup.py::test_startup_no_plan_times_out_with_an_error",
    "test_startup.py::test_startup_node_with_another_cpu_count_plans_by_itself",
    "test_startup.py::test_startup_planner_and_ranks_use_one_cache_rule",
    "test_startup.py::test_startup_planner_prunes_old_plans",
    "test_startup.py::test_startup_rank_runs_from_its_jobs_plan",
    "test_startup.py::test_startup_site_profile_node_local_job_dir",
    "test_startup.py::test_startup_stale_plan_is_an_error",
    "test_suite_rules.py",
    "test_testbed.py",
    "test_topology.py",
    "test_validate.py::test_a_launch_that_does_not_end_is_stopped_with_its_children",
    "test_validate.py::test_a_size_line_says_when_trials_timed_fewer_samples",
    "test_validate.py::test_a_size_split_around_the_floor_gets_more_trials",
    "test_validate.py::test_launch_warnings_name_the_trials_and_the_whole_message",
    "test_validate.py::test_max_trials_equal_to_trials_never_extends",
    "test_validate.py::test_mpi_cpu_and_fabric_checks",
    "test_validate.py::test_only_names_checks_in_their_order_with_world_and_the_probe_follows",
    "test_validate.py::test_without_speed_each_side_runs_once_and_only_the_named_checks_judge",
    "test_validate.py::test_world_checks",
})
NOT_FAST_MARKS = ("mpi", "slurm", "container")


def is_fast(nodeid: str, entries: frozenset[str] | None = None) -> bool:
    """Whether the test ``nodeid`` (``tests/test_x.py::test_y[param]``) is listed in
    ``entries`` (default :data:`FAST`)."""
    entries = FAST if entries is None else entries
    path, _, rest = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1]
    return name in entries or f"{name}::{rest.split('[', 1)[0]}" in entries


def mark_fast_tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the listed tests ``fast``; a listed test that is marked as slow work stops the
    session (``pytest.UsageError``)."""
    wrong = []
    for item in items:
        if is_fast(item.nodeid):
            item.add_marker(pytest.mark.fast)
            marks = [m for m in NOT_FAST_MARKS if item.get_closest_marker(m)]
            if marks:
                wrong.append(f"{item.nodeid} ({', '.join(marks)})")
    if wrong:
        raise pytest.UsageError("listed in tests/fast_tier.py but marked as slow work: "
                                + "; ".join(wrong))
