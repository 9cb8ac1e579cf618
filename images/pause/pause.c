/* The pod sandbox's process on the local real node (cluster/real-node.sh): it holds the
 * pod's namespaces, reaps what is re-parented to it, and exits at once on SIGTERM or SIGINT,
 * so that a pod's teardown never waits out a kill timeout. No registry is reachable here to
 * pull the usual pause image, so the node's sandbox image is built from this file. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction on_stop = {.sa_handler = stop};
  struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
  sigaction(SIGINT, &on_stop, NULL);
  sigaction(SIGTERM, &on_stop, NULL);
  sigaction(SIGCHLD, &on_child, NULL);
  for (;;) pause();
}
