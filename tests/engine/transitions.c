/*
 * Every move between the engine's states, tried from every state: prints one line
 * per pair, "<from> <to> <0|-1> <state after>", and one per state,
 * "off <state> <0|1>" (is_released). tests/test_engine_state.py holds them against the table
 * of legal moves it writes itself.
 */
#include "state.h"

#include <stdio.h>

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	for (int from = 0; from < NSTATES; from++) {
		for (int to = 0; to < NSTATES; to++) {
			engine.state = (enum swap_state)from;
			int r = transition((enum swap_state)from, (enum swap_state)to);
			printf("%s %s %d %s\n", state_name((enum swap_state)from),
			       state_name((enum swap_state)to), r, state_name(engine.state));
		}
		engine.state = (enum swap_state)from;
		printf("off %s %d\n", state_name((enum swap_state)from), is_released());
	}
	/* A move from a state the process is not in: refused, whatever the table says. */
	engine.state = STATE_RESIDENT;
	int r = transition(STATE_RELEASED, STATE_RESTORING);
	printf("stale released restoring %d %s\n", r, state_name(engine.state));
	return 0;
}
