/*
 * vramlock's SPANK plugin: every task of a Slurm job that was given a GPU (or a shard of
 * one) runs as a member of that GPU's arena, under `vramlock run`, without a change to
 * the job's script. The task's program is started by the launcher (slurm-task, next to
 * this file) in its place, which execs `vramlock run --arena ARENA -- PROGRAM ARGS...`.
 *
 * Only the task's argv[0] changes, just before slurmstepd execs it, and after it has
 * set the task up: the site's TaskProlog, TMPDIR, limits and CUDA_VISIBLE_DEVICES stay
 * as Slurm makes them, and squeue and sacct show the job's own command.
 *
 * plugstack.conf:
 *   required /usr/local/lib/vramlock/vramlock_spank.so launcher=/usr/local/lib/vramlock/slurm-task
 *       arenas=/run/vramlock-slurm/vramlock vramlock=/usr/local/bin/vramlock
 *
 * A job opts out with `--vramlock=off` (sbatch, srun, salloc): its tasks then say so on
 * their stderr, once each, and run as they would without the plugin.
 *
 * A step that srun starts inside a job whose batch step is a member runs on that
 * member's turn, not as a member of its own (it would wait for its own job's token).
 *
 * Build: cc -std=c11 -O2 -Wall -Wextra -fPIC -shared -o vramlock_spank.so vramlock_spank.c
 * (the headers are Debian's libslurm-dev).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/slurm.h>
#include <slurm/spank.h>

SPANK_PLUGIN(vramlock, 1);

static int opted_out;

static int take_option(int val, const char *optarg, int remote)
{
	(void)val;
	(void)remote;
	if (optarg && strcmp(optarg, "off") == 0)
		opted_out = 1;
	else if (optarg && strcmp(optarg, "on") == 0)
		opted_out = 0;
	else
		return -1; /* Slurm says "Invalid --vramlock argument: WORD", once */
	return 0;
}

static struct spank_option option = {
	"vramlock", "on|off",
	"off: this job's GPU work does not take turns with other jobs through vramlock "
	"(default on)",
	1, 0, take_option,
};

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	return spank_option_register(sp, &option) == ESPANK_SUCCESS ? 0 : -1;
}

/* The value of "NAME=value" among the plugin's arguments, or NULL. */
static const char *argument(int ac, char **av, const char *name)
{
	size_t n = strlen(name);
	for (int i = 0; i < ac; i++)
		if (strncmp(av[i], name, n) == 0 && av[i][n] == '=')
			return av[i] + n + 1;
	return NULL;
}

static int job_env(spank_t sp, const char *name, char *buf, int size)
{
	return spank_getenv(sp, name, buf, size) == ESPANK_SUCCESS && buf[0];
}

/* The task's GPUs, Slurm's indexes of them on the node ("0", "0,1"): 1; 0 for none; -1
 * (said) for a list not understood, rather than a task on a GPU outside its arena.
 * Slurm sets them for a batch step in SLURM_JOB_GPUS, for any other in SLURM_STEP_GPUS. */
static int gpus_of(spank_t sp, uint32_t step, char *gpus, int size)
{
	const char *name = step == SLURM_BATCH_SCRIPT ? "SLURM_JOB_GPUS" : "SLURM_STEP_GPUS";
	if (!job_env(sp, name, gpus, size))
		return 0;
	for (const char *c = gpus; *c; c++)
		if ((*c < '0' || *c > '9') && *c != ',') {
			slurm_error("vramlock: %s=%s: not a list of GPU indexes", name, gpus);
			return -1;
		}
	return 1;
}

/*
 * A step inside a member's job got the member's environment from srun: the swap
 * library in LD_PRELOAD and the member's socket and descriptors, which are not the
 * step's (its processes are none of the member's, whose hub turns them away). It runs
 * without them, on the member's turn.
 */
static int inside_member(spank_t sp)
{
	static const char *const member[] = {"VRAMLOCK_SWAP_SOCKET", "VRAMLOCK_CONTROL_FD",
					     "VRAMLOCK_TOKEN_FD"};
	char preload[8192], kept[8192] = "";
	size_t used = 0;

	for (size_t i = 0; i < sizeof member / sizeof member[0]; i++)
		spank_unsetenv(sp, member[i]);
	if (!job_env(sp, "LD_PRELOAD", preload, sizeof preload))
		return 0;
	for (char *save = NULL, *lib = strtok_r(preload, " :", &save); lib;
	     lib = strtok_r(NULL, " :", &save)) {
		const char *base = strrchr(lib, '/') ? strrchr(lib, '/') + 1 : lib;
		if (strncmp(base, "libvramlock-swap", strlen("libvramlock-swap")) == 0)
			continue;
		if (used >= sizeof kept)
			break; /* cannot be: what is kept is shorter than what was read */
		used += snprintf(kept + used, sizeof kept - used, "%s%s", used ? ":" : "", lib);
	}
	if (!used)
		return spank_unsetenv(sp, "LD_PRELOAD") == ESPANK_SUCCESS ? 0 : -1;
	return spank_setenv(sp, "LD_PRELOAD", kept, 1) == ESPANK_SUCCESS ? 0 : -1;
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	const char *launcher = argument(ac, av, "launcher");
	const char *arenas = argument(ac, av, "arenas");
	const char *vramlock = argument(ac, av, "vramlock");
	char gpus[256], arena[4096], job[64], member[64];
	int argc = 0;
	char **argv = NULL;
	uint32_t step = 0, id = 0;
	int found;

	if (!spank_remote(sp))
		return 0;
	if (!launcher || !arenas || !vramlock) {
		slurm_error("vramlock: plugstack.conf must give launcher=, arenas= and vramlock=");
		return -1;
	}
	if (spank_get_item(sp, S_JOB_STEPID, &step) != ESPANK_SUCCESS) {
		slurm_error("vramlock: no step id");
		return -1;
	}
	found = gpus_of(sp, step, gpus, sizeof gpus);
	if (found <= 0)
		return found; /* 0: no GPU, nothing to share */
	if (snprintf(arena, sizeof arena, "%s/gpu%.*s", arenas, (int)strcspn(gpus, ","),
		     gpus) >= (int)sizeof arena)
		return -1;
	if (spank_get_item(sp, S_JOB_ID, &id) != ESPANK_SUCCESS) {
		slurm_error("vramlock: no job id");
		return -1;
	}
	snprintf(job, sizeof job, "%u", (unsigned)id);
	/* A step started inside a job whose batch step is a member already (srun in a
	 * batch script): that member holds the GPU for it; a second one would wait for it.
	 * The batch step itself is inside none, whatever its environment says. */
	if (step != SLURM_BATCH_SCRIPT &&
	    job_env(sp, "VRAMLOCK_SLURM_JOB", member, sizeof member) && strcmp(member, job) == 0)
		return inside_member(sp);
	if (opted_out) {
		fprintf(stderr, "vramlock: job %s opted out (--vramlock=off): its GPU work does "
			"not take turns with other jobs on %s\n", job, arena);
		return 0;
	}
	if (spank_get_item(sp, S_JOB_ARGV, &argc, &argv) != ESPANK_SUCCESS || argc < 1 ||
	    !argv || !argv[0])
		return 0;
	if (spank_setenv(sp, "VRAMLOCK_SLURM_PROGRAM", argv[0], 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "VRAMLOCK_SLURM_ARENA", arena, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "VRAMLOCK_SLURM_GPUS", gpus, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "VRAMLOCK_SLURM_RUN", vramlock, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "VRAMLOCK_SLURM_JOB", job, 1) != ESPANK_SUCCESS) {
		slurm_error("vramlock: cannot set the task's environment");
		return -1;
	}
	argv[0] = strdup(launcher);
	return argv[0] ? 0 : -1;
}
